"use client";

import { useSyncExternalStore } from "react";

type Theme = "light" | "dark";
const KEY = "hearth.theme";
const CHANGED = "hearth-theme";

function effective(): Theme {
  const set = document.documentElement.dataset.theme;
  if (set === "light" || set === "dark") return set;
  return window.matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light";
}

function subscribe(onChange: () => void): () => void {
  const mq = window.matchMedia("(prefers-color-scheme: dark)");
  mq.addEventListener("change", onChange);
  window.addEventListener(CHANGED, onChange);
  return () => {
    mq.removeEventListener("change", onChange);
    window.removeEventListener(CHANGED, onChange);
  };
}

/** Follows the system until toggled; the choice is remembered in local storage. */
export function ThemeToggle() {
  const theme = useSyncExternalStore<Theme | null>(subscribe, effective, () => null);
  const next: Theme = theme === "dark" ? "light" : "dark";
  return (
    <button
      type="button"
      className="icon"
      aria-label={`Switch to ${next} theme`}
      title={`Switch to ${next} theme`}
      onClick={() => {
        document.documentElement.dataset.theme = next;
        try {
          localStorage.setItem(KEY, next);
        } catch {
          // not remembered
        }
        window.dispatchEvent(new Event(CHANGED));
      }}
    >
      {theme === "dark" ? "☀" : "☾"}
    </button>
  );
}
