// The header's server status: readiness (GET /readyz) and the served model's name, polled every
// 15 s while the page may call the API. A failed model lookup keeps the last name shown.

import { useEffect, useState } from "react";
import { api } from "@/lib/api";

export function useHealth(enabled: boolean) {
  const [model, setModel] = useState<string | null>(null);
  /** null until the first answer. */
  const [ready, setReady] = useState<boolean | null>(null);

  useEffect(() => {
    if (!enabled) return;
    let alive = true;
    const poll = async () => {
      try {
        const r = await api.ready();
        if (alive) setReady(r.ready);
      } catch {
        if (alive) setReady(false);
      }
      try {
        const m = await api.model();
        if (alive) setModel(m);
      } catch {
        // keep the last name
      }
    };
    void poll();
    const t = setInterval(poll, 15_000);
    return () => {
      alive = false;
      clearInterval(t);
    };
  }, [enabled]);

  return { model, ready };
}
