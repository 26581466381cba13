// Shapes of the public API, generated from the server's OpenAPI document
// (orchestrator/openapi.json → lib/api-schema.d.ts, `npm run api-types`; `make openapi` regenerates
// both). `npm run typecheck` fails when the generated file is out of date, so a change to the
// server's types that this UI does not follow fails its build. Timestamps are Unix milliseconds.

import type { components } from "./api-schema";

type Schemas = components["schemas"];

export type Role = Schemas["Role"];
export type MessageStatus = Schemas["MessageStatus"];
export type ApiMessage = Schemas["Message"];
export type ToolCall = Schemas["ToolCall"];
export type SamplingParams = Schemas["SamplingParams"];
export type Session = Schemas["Session"];
export type SessionPage = Schemas["SessionPage"];
/** The session fields a client sets on PATCH (`null` clears one); create takes the same. */
export type SessionFields = Schemas["UpdateSession"];
/** The data of the native stream's events. */
export type MessageStart = Schemas["MessageStart"];
export type TokenText = Schemas["TokenText"];
export type ReplyEnd = Schemas["ReplyEnd"];
export type ReplyFailed = Schemas["ReplyFailed"];
export type ErrorBody = Schemas["ErrorBody"];
/** A served model and its versions, as GET /v1/models lists it. */
export type ModelCard = Schemas["ModelCard"];
