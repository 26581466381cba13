// The bar above the messages: the chat list's menu button (narrow screens), the chat's title,
// the server's status and model, the settings button and the theme toggle.

"use client";

import { ThemeToggle } from "./ThemeToggle";

export function TopBar({
  title,
  drawerOpen,
  onMenu,
  model,
  ready,
  onSettings,
}: {
  title: string;
  drawerOpen: boolean;
  onMenu: () => void;
  model: string | null;
  /** null until the first health check answers. */
  ready: boolean | null;
  onSettings: () => void;
}) {
  return (
    <header className="top">
      <button
        type="button"
        className="icon menu"
        aria-label="Open chats"
        aria-controls="sidebar"
        aria-expanded={drawerOpen}
        onClick={onMenu}
      >
        ☰
      </button>
      <h1 className="title" title={title}>
        {title}
      </h1>
      <span className="health" role="status" aria-label="Server status">
        <span className={ready === null ? "dot" : ready ? "dot ok" : "dot bad"} aria-hidden="true" />
        <span className="model">{model ?? "…"}</span>
        <span className="sr-only">{ready === null ? "checking" : ready ? "ready" : "not ready"}</span>
      </span>
      <button type="button" className="icon" aria-label="Chat settings" title="Chat settings" onClick={onSettings}>
        ⚙
      </button>
      <ThemeToggle />
    </header>
  );
}
