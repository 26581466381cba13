"use client";

import { useState } from "react";
import { modelChoices, type SettingsValue } from "@/lib/settings";
import type { ModelCard } from "@/lib/types";

export type { SettingsValue };

function check(v: SettingsValue): string | null {
  const t = v.temperature.trim();
  if (t && !(Number(t) >= 0 && Number(t) <= 2)) return "Temperature must be between 0 and 2.";
  const p = v.topP.trim();
  if (p && !(Number(p) > 0 && Number(p) <= 1)) return "Top-p must be above 0 and at most 1.";
  const k = v.topK.trim();
  if (k && !(Number.isInteger(Number(k)) && Number(k) >= 0)) return "Top-k must be a whole number, 0 or more.";
  const d = v.dry.trim();
  if (d && !(Number(d) >= 0 && Number(d) <= 10)) return "Repetition guard must be between 0 and 10.";
  const m = v.maxTokens.trim();
  if (m && !(Number.isInteger(Number(m)) && Number(m) >= 1)) return "Max tokens must be a whole number, 1 or more.";
  return null;
}

export function Settings({
  initial,
  models,
  onSave,
  onClose,
}: {
  initial: SettingsValue;
  /** The served models; the list shows when there is a choice to make (or the chat names one). */
  models: ModelCard[];
  onSave: (v: SettingsValue) => Promise<void>;
  onClose: () => void;
}) {
  const [v, setV] = useState(initial);
  const [error, setError] = useState<string | null>(null);
  const [saving, setSaving] = useState(false);
  const field = (name: keyof SettingsValue) => ({
    value: v[name],
    onChange: (e: React.ChangeEvent<HTMLInputElement | HTMLTextAreaElement | HTMLSelectElement>) =>
      setV({ ...v, [name]: e.target.value }),
  });
  const choices = modelChoices(models);
  // A model the chat names that no worker lists now stays selectable, so saving keeps it.
  if (v.model && !choices.some((c) => c.value === v.model)) choices.push({ value: v.model, label: `${v.model}: not served now` });
  return (
    <div className="overlay" onMouseDown={(e) => e.target === e.currentTarget && onClose()}>
      <form
        role="dialog"
        aria-modal="true"
        aria-labelledby="settings-title"
        className="card dialog"
        onKeyDown={(e) => {
          if (e.key === "Escape") {
            e.preventDefault(); // closes the dialog only; a running reply keeps going
            onClose();
          }
        }}
        onSubmit={async (e) => {
          e.preventDefault();
          const bad = check(v);
          if (bad) return setError(bad);
          setSaving(true);
          try {
            await onSave(v);
            onClose();
          } catch (err) {
            setError(err instanceof Error ? err.message : String(err));
          } finally {
            setSaving(false);
          }
        }}
      >
        <h2 id="settings-title">Chat settings</h2>
        {(choices.length > 1 || v.model) && (
          <>
            <label htmlFor="set-model">Model</label>
            <select id="set-model" {...field("model")}>
              <option value="">Server default{models[0] ? ` (${models[0].id})` : ""}</option>
              {choices.map((c) => (
                <option key={c.value} value={c.value}>
                  {c.label}
                </option>
              ))}
            </select>
          </>
        )}
        <label htmlFor="set-system">System prompt</label>
        <textarea id="set-system" rows={4} {...field("systemPrompt")} autoFocus />
        <div className="grid">
          <div>
            <label htmlFor="set-temp">Temperature</label>
            <input id="set-temp" inputMode="decimal" placeholder="0" {...field("temperature")} />
          </div>
          <div>
            <label htmlFor="set-topp">Top-p</label>
            <input id="set-topp" inputMode="decimal" placeholder="1" {...field("topP")} />
          </div>
          <div>
            <label htmlFor="set-topk">Top-k</label>
            <input id="set-topk" inputMode="numeric" placeholder="0 (off)" {...field("topK")} />
          </div>
          <div>
            <label htmlFor="set-max">Max tokens</label>
            <input id="set-max" inputMode="numeric" placeholder="server default" {...field("maxTokens")} />
          </div>
          <div>
            <label htmlFor="set-dry" title="DRY: penalizes repeating earlier text, so replies do not loop">
              Repetition guard (DRY)
            </label>
            <input id="set-dry" inputMode="decimal" placeholder="0 (off)" {...field("dry")} />
          </div>
        </div>
        {error && (
          <p role="alert" className="error-text">
            {error}
          </p>
        )}
        <div className="row end">
          <button type="button" onClick={onClose}>
            Cancel
          </button>
          <button type="submit" className="primary" disabled={saving}>
            Save
          </button>
        </div>
      </form>
    </div>
  );
}
