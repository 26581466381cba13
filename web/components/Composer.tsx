// The message box: Enter sends, Shift+Enter adds a line (and Enter while an input method is
// composing does neither); it grows to 8 rows. While a reply runs, Send becomes Stop.

"use client";

export function Composer({
  draft,
  onDraft,
  onSend,
  busy,
  onStop,
  inputRef,
}: {
  draft: string;
  onDraft: (text: string) => void;
  onSend: () => void;
  busy: boolean;
  onStop: () => void;
  inputRef: React.Ref<HTMLTextAreaElement>;
}) {
  return (
    <form
      className="composer"
      onSubmit={(e) => {
        e.preventDefault();
        onSend();
      }}
    >
      <textarea
        ref={inputRef}
        aria-label="Message"
        placeholder="Message Hearth"
        rows={Math.min(8, Math.max(1, draft.split("\n").length))}
        value={draft}
        onChange={(e) => onDraft(e.target.value)}
        onKeyDown={(e) => {
          if (e.key === "Enter" && !e.shiftKey && !e.nativeEvent.isComposing) {
            e.preventDefault();
            onSend();
          }
        }}
      />
      {busy ? (
        <button type="button" className="stop" onClick={onStop} aria-label="Stop reply">
          ■ Stop
        </button>
      ) : (
        <button type="submit" className="primary" aria-label="Send message" disabled={!draft.trim()}>
          Send
        </button>
      )}
    </form>
  );
}
