// Shapes of the public API (README "Orchestrator"). Timestamps are Unix milliseconds.

export type Role = "user" | "assistant";
export type MessageStatus = "complete" | "streaming" | "stopped" | "error";

export interface ApiMessage {
  id: string;
  seq: number;
  role: Role;
  content: string;
  status: MessageStatus;
  finish_reason: string | null;
  prompt_tokens: number | null;
  cached_tokens: number | null;
  completion_tokens: number | null;
  ttft_ms: number | null;
  duration_ms: number | null;
  worker: string | null;
  created_at: number;
  updated_at: number;
}

export interface SamplingParams {
  temperature?: number;
  top_k?: number;
  top_p?: number;
  min_p?: number;
  repetition_penalty?: number;
  seed?: number | null;
}

export interface Session {
  id: string;
  title: string;
  system_prompt: string | null;
  params: SamplingParams | null;
  /** Default reply length for the session's turns (server default when null). */
  max_tokens: number | null;
  created_at: number;
  updated_at: number;
}

export interface SessionPage {
  data: Session[];
  next_cursor: string | null;
}
