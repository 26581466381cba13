// Per-chat settings (system prompt, sampling, max tokens) behind the settings dialog: what the
// form starts from, and where a save goes: a PATCH of the open chat, or, before the chat
// exists, the settings its first message will create it with.

import { useState } from "react";
import { api } from "@/lib/api";
import { settingsFrom, settingsPatch, type SettingsValue } from "@/lib/settings";
import type { Session } from "@/lib/types";

export function useSettings({
  sessionId,
  session,
  setSession,
  pendingSettings,
  setPendingSettings,
  upsert,
}: {
  sessionId: string | null;
  session: Session | null;
  setSession: (s: Session) => void;
  pendingSettings: SettingsValue | null;
  setPendingSettings: (v: SettingsValue | null) => void;
  upsert: (s: Session) => void;
}) {
  const [open, setOpen] = useState(false);

  const initial = (): SettingsValue => {
    if (!sessionId && pendingSettings) return pendingSettings;
    return settingsFrom(session);
  };

  const save = async (v: SettingsValue) => {
    if (!sessionId) return setPendingSettings(v);
    const s = await api.patchSession(sessionId, settingsPatch(v, session?.params ?? null));
    setSession(s);
    upsert(s);
  };

  return { open, show: () => setOpen(true), close: () => setOpen(false), initial, save };
}
