// Asks before a chat is deleted (it cannot be undone). Cancel has the focus; Esc cancels.

"use client";

import type { Session } from "@/lib/types";

export function ConfirmDelete({
  session,
  onCancel,
  onConfirm,
}: {
  session: Session;
  onCancel: () => void;
  onConfirm: () => void;
}) {
  return (
    <div className="overlay">
      <div
        role="alertdialog"
        aria-modal="true"
        aria-labelledby="del-title"
        className="card dialog"
        onKeyDown={(e) => {
          if (e.key === "Escape") {
            e.preventDefault();
            onCancel();
          }
        }}
      >
        <h2 id="del-title">Delete chat?</h2>
        <p>
          “{session.title}” and all its messages will be deleted. This cannot be undone.
        </p>
        <div className="row end">
          <button type="button" onClick={onCancel} autoFocus>
            Cancel
          </button>
          <button type="button" className="danger" onClick={onConfirm}>
            Delete
          </button>
        </div>
      </div>
    </div>
  );
}
