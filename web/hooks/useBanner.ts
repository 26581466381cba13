// The banner's state: the notice shown (lib/banner.ts says which), and a clock that ticks while
// a rate-limited retry counts down, so the seconds left re-render.

import { useCallback, useEffect, useState } from "react";
import { refusalBanner, secondsLeft, type Banner } from "@/lib/banner";

export function useBanner() {
  const [banner, setBanner] = useState<Banner | null>(null);
  const [now, setNow] = useState(() => Date.now());

  useEffect(() => {
    if (!banner?.retryAt) return;
    const t = setInterval(() => setNow(Date.now()), 500);
    return () => clearInterval(t);
  }, [banner]);

  /** Shows why the server refused a request; `retry` makes it again. A 401 shows nothing here. */
  const showRefusal = useCallback((e: unknown, retry: () => void) => {
    const at = Date.now();
    const b = refusalBanner(e, retry, at);
    if (!b) return;
    if (b.retryAt !== undefined) setNow(at);
    setBanner(b);
  }, []);

  return { banner, setBanner, showRefusal, waitSecs: secondsLeft(banner, now) };
}
