import type { NextConfig } from "next";

// Production builds are a static export (web/out) that `hearth` serves on the API's origin.
// `npm run dev` instead proxies the API to a running orchestrator (HEARTH_URL); rewrites are
// not allowed together with `output: "export"`, so each mode gets only its own setting.
const isDev = process.env.NODE_ENV === "development";
const upstream = process.env.HEARTH_URL ?? "http://127.0.0.1:8080";

const config: NextConfig = isDev
  ? {
      async rewrites() {
        return [
          { source: "/v1/:path*", destination: `${upstream}/v1/:path*` },
          { source: "/healthz", destination: `${upstream}/healthz` },
          { source: "/readyz", destination: `${upstream}/readyz` },
        ];
      },
    }
  : {
      output: "export",
      images: { unoptimized: true },
      poweredByHeader: false,
    };

export default config;
