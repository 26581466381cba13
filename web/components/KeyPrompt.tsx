"use client";

import { useState } from "react";

export function KeyPrompt({ onKey, error }: { onKey: (key: string) => void; error: string | null }) {
  const [key, setKey] = useState("");
  return (
    <main className="key-prompt">
      <form
        className="card"
        onSubmit={(e) => {
          e.preventDefault();
          if (key.trim()) onKey(key.trim());
        }}
      >
        <h1>Hearth</h1>
        <p>This server needs an API key. Ask its operator for one (<code>hearth keys create</code>).</p>
        <label htmlFor="api-key">API key</label>
        <input
          id="api-key"
          type="password"
          autoComplete="off"
          placeholder="hk_…"
          value={key}
          onChange={(e) => setKey(e.target.value)}
          autoFocus
        />
        {error && (
          <p role="alert" className="error-text">
            {error}
          </p>
        )}
        <button type="submit" className="primary" disabled={!key.trim()}>
          Continue
        </button>
        <p className="muted small">The key is kept in this browser&apos;s local storage.</p>
      </form>
    </main>
  );
}
