// Keeps the newest message in view while a reply grows, unless the reader has scrolled up
// (more than 80 px from the bottom); a new turn scrolls back down.

import { useCallback, useEffect, useRef } from "react";

export function useStickToBottom(messages: unknown) {
  /** An empty element after the last message, scrolled into view. */
  const bottom = useRef<HTMLDivElement>(null);
  const stick = useRef(true);

  useEffect(() => {
    if (stick.current) bottom.current?.scrollIntoView({ block: "end" });
  }, [messages]);

  const onScroll = useCallback((e: React.UIEvent<HTMLElement>) => {
    const el = e.currentTarget;
    stick.current = el.scrollHeight - el.scrollTop - el.clientHeight < 80;
  }, []);

  /** Follow the list again (the next change scrolls to the bottom). */
  const stickToBottom = useCallback(() => {
    stick.current = true;
  }, []);

  return { bottom, onScroll, stickToBottom };
}
