// The header's server status: readiness (GET /readyz) and the served models (GET /v1/models),
// polled every 15 s while the page may call the API. A failed model lookup keeps the last list.

import { useEffect, useState } from "react";
import { api } from "@/lib/api";
import type { ModelCard } from "@/lib/types";

export function useHealth(enabled: boolean) {
  const [models, setModels] = useState<ModelCard[]>([]);
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
        const m = await api.models();
        if (alive) setModels(m);
      } catch {
        // keep the last list
      }
    };
    void poll();
    const t = setInterval(poll, 15_000);
    return () => {
      alive = false;
      clearInterval(t);
    };
  }, [enabled]);

  return { models, ready };
}
