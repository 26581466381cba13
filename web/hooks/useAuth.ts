// Whether the page may call the API: it first tries without a key (or with the stored one), and
// any 401, then or later, asks for a key. `submitKey` checks a typed key before accepting it.

import { useEffect, useState } from "react";
import { api, ApiError, loadKey, setKey, setUnauthorizedHandler } from "@/lib/api";

export type Auth = "checking" | "need-key" | "ok";

export function useAuth() {
  const [auth, setAuth] = useState<Auth>("checking");
  const [keyError, setKeyError] = useState<string | null>(null);

  useEffect(() => {
    setUnauthorizedHandler((hadKey) => {
      setKey(null);
      setKeyError(hadKey ? "The API key was not accepted. Enter a valid key." : null);
      setAuth("need-key");
    });
    loadKey();
    api
      .listSessions({ limit: 1 })
      .then(() => setAuth("ok"))
      .catch((e) => {
        if (!(e instanceof ApiError && e.status === 401)) setAuth("ok");
      });
    return () => setUnauthorizedHandler(null);
  }, []);

  const submitKey = async (key: string) => {
    setKey(key);
    try {
      await api.listSessions({ limit: 1 });
      setKeyError(null);
      setAuth("ok");
    } catch (e) {
      // A 401 has already gone through the unauthorized handler, which set the message.
      if (!(e instanceof ApiError && e.status === 401)) {
        setKeyError(e instanceof Error ? e.message : String(e));
      }
    }
  };

  return { auth, keyError, submitKey };
}
