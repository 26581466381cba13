"use client";

import { useEffect, useRef, useState } from "react";
import type { Session } from "@/lib/types";

function dayLabel(ms: number, now = new Date()): string {
  const d = new Date(ms);
  const startOf = (x: Date) => new Date(x.getFullYear(), x.getMonth(), x.getDate()).getTime();
  const days = Math.round((startOf(now) - startOf(d)) / 86_400_000);
  if (days === 0) return "Today";
  if (days === 1) return "Yesterday";
  return d.toLocaleDateString(undefined, { year: "numeric", month: "short", day: "numeric" });
}

function groupByDay(sessions: Session[]): [string, Session[]][] {
  const groups: [string, Session[]][] = [];
  for (const s of sessions) {
    const label = dayLabel(s.updated_at);
    const last = groups[groups.length - 1];
    if (last && last[0] === label) last[1].push(s);
    else groups.push([label, [s]]);
  }
  return groups;
}

function Item({
  s,
  active,
  onOpen,
  onRename,
  onDelete,
}: {
  s: Session;
  active: boolean;
  onOpen: () => void;
  onRename: (title: string) => Promise<void>;
  onDelete: () => void;
}) {
  const [editing, setEditing] = useState(false);
  const [title, setTitle] = useState(s.title);
  if (editing) {
    return (
      <li className="session editing">
        <form
          onSubmit={async (e) => {
            e.preventDefault();
            if (title.trim() && title.trim() !== s.title) await onRename(title.trim());
            setEditing(false);
          }}
        >
          <input
            aria-label="New title"
            value={title}
            maxLength={200}
            autoFocus
            onChange={(e) => setTitle(e.target.value)}
            onKeyDown={(e) => {
              if (e.key === "Escape") {
                e.preventDefault();
                setTitle(s.title);
                setEditing(false);
              }
            }}
          />
          <button type="submit" aria-label="Save title">
            Save
          </button>
        </form>
      </li>
    );
  }
  return (
    <li className={active ? "session active" : "session"}>
      <a
        href={`?s=${s.id}`}
        aria-current={active ? "page" : undefined}
        onClick={(e) => {
          e.preventDefault();
          onOpen();
        }}
      >
        {s.title}
      </a>
      <button
        type="button"
        className="icon"
        aria-label={`Rename ${s.title}`}
        title="Rename"
        onClick={() => {
          setTitle(s.title);
          setEditing(true);
        }}
      >
        ✎
      </button>
      <button type="button" className="icon" aria-label={`Delete ${s.title}`} title="Delete" onClick={onDelete}>
        ✕
      </button>
    </li>
  );
}

export function Sidebar({
  sessions,
  activeId,
  hasMore,
  loading,
  query,
  onQuery,
  onMore,
  onOpen,
  onNew,
  onRename,
  onDelete,
}: {
  sessions: Session[];
  activeId: string | null;
  hasMore: boolean;
  loading: boolean;
  query: string;
  onQuery: (q: string) => void;
  onMore: () => void;
  onOpen: (id: string) => void;
  onNew: () => void;
  onRename: (id: string, title: string) => Promise<void>;
  onDelete: (s: Session) => void;
}) {
  const sentinel = useRef<HTMLDivElement>(null);
  useEffect(() => {
    const el = sentinel.current;
    if (!el || !hasMore) return;
    const io = new IntersectionObserver((entries) => {
      if (entries.some((e) => e.isIntersecting) && !loading) onMore();
    });
    io.observe(el);
    return () => io.disconnect();
  }, [hasMore, loading, onMore]);
  return (
    <nav className="sidebar-inner" aria-label="Chats">
      <button type="button" className="primary new-chat" onClick={onNew} title="New chat (Ctrl+Shift+O)">
        + New chat
      </button>
      <input
        type="search"
        className="search"
        aria-label="Search chats"
        placeholder="Search chats"
        value={query}
        onChange={(e) => onQuery(e.target.value)}
      />
      <div className="session-list">
        {groupByDay(sessions).map(([label, items]) => (
          <section key={label} aria-label={label}>
            <h3>{label}</h3>
            <ul>
              {items.map((s) => (
                <Item
                  key={s.id}
                  s={s}
                  active={s.id === activeId}
                  onOpen={() => onOpen(s.id)}
                  onRename={(t) => onRename(s.id, t)}
                  onDelete={() => onDelete(s)}
                />
              ))}
            </ul>
          </section>
        ))}
        {!loading && sessions.length === 0 && <p className="muted small pad">{query ? "No chats match." : "No chats yet."}</p>}
        <div ref={sentinel} className="sentinel" />
        {loading && <p className="muted small pad">Loading…</p>}
      </div>
    </nav>
  );
}
