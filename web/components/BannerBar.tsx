// The notice above the composer (lib/banner.ts): a refused request's reason, a Retry button
// (held disabled while a rate limit counts down) and a dismiss button.

"use client";

import type { Banner } from "@/lib/banner";

export function BannerBar({
  banner,
  waitSecs,
  onDismiss,
}: {
  banner: Banner;
  /** Seconds until a rate-limited retry may be made. */
  waitSecs: number;
  onDismiss: () => void;
}) {
  return (
    <div className={`banner ${banner.kind}`} role="alert">
      <span>
        {banner.message}
        {banner.kind === "rate" && (waitSecs > 0 ? ` Retry in ${waitSecs} s.` : " You can retry now.")}
      </span>
      {banner.retry && (
        <button type="button" onClick={banner.retry} disabled={waitSecs > 0}>
          Retry
        </button>
      )}
      <button type="button" className="icon" aria-label="Dismiss" onClick={onDismiss}>
        ✕
      </button>
    </div>
  );
}
