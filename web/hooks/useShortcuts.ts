// Page-wide keys: Esc stops a running reply (unless something nearer, such as a dialog, took the
// key first) and Ctrl/Cmd+Shift+O starts a new chat.

import { useEffect, useRef } from "react";

export function useShortcuts({
  isRunning,
  stop,
  newChat,
}: {
  isRunning: () => boolean;
  stop: () => Promise<void>;
  newChat: () => void;
}) {
  const newChatRef = useRef(newChat);
  useEffect(() => {
    newChatRef.current = newChat;
  });
  useEffect(() => {
    const onKey = (e: KeyboardEvent) => {
      if (e.key === "Escape" && isRunning() && !e.defaultPrevented) {
        e.preventDefault();
        void stop();
      } else if ((e.ctrlKey || e.metaKey) && e.shiftKey && e.key.toLowerCase() === "o") {
        e.preventDefault();
        newChatRef.current();
      }
    };
    window.addEventListener("keydown", onKey);
    return () => window.removeEventListener("keydown", onKey);
  }, [isRunning, stop]);
}
