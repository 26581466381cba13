// Prints the JavaScript the exported chat page (out/index.html) loads: each script's raw and
// gzipped size, and the totals. Run after `npm run build`: `npm run size`.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { gzipSync } from "node:zlib";

const out = join(import.meta.dirname, "..", "out");
const html = readFileSync(join(out, "index.html"), "utf8");
// `noModule` scripts (legacy polyfills) are never loaded by the browsers that run modules.
const tags = [...html.matchAll(/<script[^>]*\ssrc="([^"]+)"[^>]*>/g)];
const srcs = [...new Set(tags.filter((m) => !/\snoModule/i.test(m[0])).map((m) => m[1]))];
const inline = [...html.matchAll(/<script(?![^>]*\ssrc=)[^>]*>([\s\S]*?)<\/script>/g)].map((m) => m[1]).join("");
let raw = 0;
let gz = 0;
for (const src of srcs) {
  const body = readFileSync(join(out, src.replace(/^\//, "").split("?")[0]));
  const g = gzipSync(body, { level: 9 }).length;
  raw += body.length;
  gz += g;
  console.log(`${(g / 1024).toFixed(1).padStart(7)} KiB gz  ${(body.length / 1024).toFixed(1).padStart(7)} KiB  ${src}`);
}
const ig = gzipSync(Buffer.from(inline), { level: 9 }).length;
console.log(`${(ig / 1024).toFixed(1).padStart(7)} KiB gz  ${(inline.length / 1024).toFixed(1).padStart(7)} KiB  (inline scripts in index.html)`);
console.log(
  JSON.stringify({ scripts: srcs.length, js_bytes: raw, js_gzip_bytes: gz, inline_gzip_bytes: ig, total_gzip_kib: +((gz + ig) / 1024).toFixed(1) }),
);
