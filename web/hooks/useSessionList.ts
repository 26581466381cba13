// The sidebar's chat list: the first page on load and after each search (debounced 250 ms),
// `before` paging on demand, and local updates when a chat is created, changed or deleted.
// A newer search supersedes any page still in flight (`listGen`).

import { useCallback, useEffect, useRef, useState } from "react";
import { api, ApiError } from "@/lib/api";
import type { Banner } from "@/lib/banner";
import { mergePage, upsertSession } from "@/lib/sessions";
import type { Session } from "@/lib/types";

const PAGE = 30;

export function useSessionList(enabled: boolean, setBanner: (b: Banner | null) => void) {
  const [sessions, setSessions] = useState<Session[]>([]);
  /** The next page's `before`; null on the last page. */
  const [cursor, setCursor] = useState<string | null>(null);
  const [loading, setLoading] = useState(false);
  const [query, setQuery] = useState("");
  /** Bumped by each first-page load; answers for an older one are dropped. */
  const listGen = useRef(0);

  const loadSessions = useCallback(
    async (q: string, before: string | null) => {
      const gen = before ? listGen.current : ++listGen.current;
      setLoading(true);
      try {
        const page = await api.listSessions({ q: q.trim() || undefined, before, limit: PAGE });
        if (gen !== listGen.current) return;
        setSessions((old) => mergePage(old, page.data, before));
        setCursor(page.next_cursor);
      } catch (e) {
        if (gen === listGen.current && !(e instanceof ApiError && e.status === 401)) {
          setBanner({ kind: "error", message: `Could not load chats: ${(e as Error).message}` });
        }
      } finally {
        if (gen === listGen.current) setLoading(false);
      }
    },
    [setBanner],
  );

  useEffect(() => {
    if (!enabled) return;
    const t = setTimeout(() => void loadSessions(query, null), query ? 250 : 0);
    return () => clearTimeout(t);
  }, [enabled, query, loadSessions]);

  const loadMore = useCallback(() => {
    if (cursor && !loading) void loadSessions(query, cursor);
  }, [cursor, loading, loadSessions, query]);

  // `upsert` stays stable (callers keep it in their own callbacks) and reads the search from here.
  const queryRef = useRef(query);
  useEffect(() => {
    queryRef.current = query;
  }, [query]);
  const upsert = useCallback((s: Session) => {
    setSessions((old) => upsertSession(old, s, queryRef.current));
  }, []);

  const remove = useCallback((id: string) => {
    setSessions((old) => old.filter((o) => o.id !== id));
  }, []);

  return { sessions, hasMore: cursor !== null, loading, query, setQuery, loadMore, upsert, remove };
}
