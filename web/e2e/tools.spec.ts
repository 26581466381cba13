import { expect, test } from "@playwright/test";
import { apiClient, stackFor } from "./stack";

// The tiny generated model: a named tool choice constrains its reply to a valid call.
const stack = stackFor();

const tools = [
  {
    type: "function",
    function: {
      name: "get_weather",
      description: "The weather in a city now",
      parameters: {
        type: "object",
        properties: { city: { type: "string", maxLength: 10 } },
        required: ["city"],
        additionalProperties: false,
      },
    },
  },
];

test("a reply's tool calls and their results show in the chat", async ({ page }) => {
  const api = apiClient(stack());
  const s = await api.createSession("Weather");
  const path = `/v1/sessions/${s.id}/messages`;
  const called = await api.call("POST", path, {
    content: "Weather in Oslo?",
    tools,
    tool_choice: { type: "function", function: { name: "get_weather" } },
    stream: false,
    max_tokens: 160,
  });
  expect(called.status, called.text).toBe(200);
  expect(called.json.finish_reason).toBe("tool_calls");
  const callId: string = called.json.tool_calls[0].id;
  const answered = await api.call("POST", path, {
    tool_results: [{ tool_call_id: callId, content: '{"temp_c": 12}' }],
    tools,
    stream: false,
    max_tokens: 4,
  });
  expect(answered.status, answered.text).toBe(200);

  await page.goto(`${stack().url}/?s=${s.id}`);
  const calls = page.getByRole("list", { name: "Tool calls" });
  await expect(calls).toContainText("Calls get_weather");
  await expect(calls.locator(`li[data-call-id="${callId}"] pre`)).toContainText('"city":');
  const result = page.getByRole("article", { name: "Tool result" });
  await expect(result).toContainText("Result of get_weather");
  await expect(result.locator("pre")).toHaveText('{"temp_c": 12}');
  await expect(page.locator("article.msg")).toHaveCount(4);
});
