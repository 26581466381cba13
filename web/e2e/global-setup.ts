import { existsSync } from "node:fs";
import { STACK_BIN, WEB_DIR } from "./stack";

export default function globalSetup() {
  if (!existsSync(`${WEB_DIR}/index.html`)) {
    throw new Error(`${WEB_DIR}/index.html is missing: run \`npm run build\` first`);
  }
  if (!existsSync(STACK_BIN)) {
    throw new Error(`${STACK_BIN} is missing: build it with \`cargo build -p hearth-e2e --bin hearth-stack\``);
  }
}
