//! Tool calling, on OpenAI's chat completions and on native turns.
//!
//! Gemma has no tool role and no call syntax of its own; its documented convention is to
//! describe the functions in the prompt and have the model answer with a JSON call. So:
//! - the tools are described in the system prompt, with the form a call takes:
//!   `{"name": …, "parameters": {…}}`, or an array of them for several calls;
//! - an assistant message's `tool_calls` are rendered in that form, and a `tool` message as a
//!   user turn holding the function's result;
//! - a reply that is such a call (optionally in a code fence) naming a known tool becomes
//!   `tool_calls`, with the finish reason `tool_calls`;
//! - with `tool_choice` `required` or a named function, the reply is constrained to a call's
//!   JSON Schema (the tool's parameters inside it), so even a base model returns a call that
//!   parses and validates.

use crate::invalid::Invalid;
use hearth_shared::Grammar;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use utoipa::ToSchema;

pub use crate::storage::{FunctionCall, ToolCall};

/// A request's tools or tool messages that cannot be served; the message starts with the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolError {
    /// A value out of range or inconsistent (a 422), and the field it is in.
    #[error("{0}")]
    Invalid(Invalid),
    /// A tool's parameters schema does not compile (a 400, as for any grammar).
    #[error("{0}")]
    InvalidGrammar(Invalid),
}

/// Most tools a request may offer (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;

/// Most calls one reply may make: as many results as a native turn may post back.
pub const MAX_CALLS: usize = 128;

/// A tool the model may call: only functions.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct Tool {
    /// `function`
    #[serde(rename = "type")]
    #[schema(pattern = "^function$")]
    kind: String,
    function: FunctionDef,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, ToSchema)]
pub struct FunctionDef {
    /// Letters, digits, `_` and `-`; at most 64.
    name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    description: Option<String>,
    /// The arguments' JSON Schema (an object); any object when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    parameters: Option<Value>,
    /// Accepted: with `tool_choice` `required` or a named function the call always follows the
    /// schema.
    #[serde(default, skip_serializing)]
    #[allow(dead_code)]
    strict: Option<bool>,
}

/// `none`, `auto`, `required`, or `{"type": "function", "function": {"name": …}}`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum ToolChoice {
    Mode(String),
    Named {
        #[serde(rename = "type")]
        kind: String,
        function: NamedFunction,
    },
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct NamedFunction {
    name: String,
}

impl Tool {
    /// A function tool, as another API than OpenAI's describes one (Anthropic's `input_schema`
    /// is OpenAI's `parameters`).
    pub fn function(name: String, description: Option<String>, parameters: Option<Value>) -> Self {
        Self {
            kind: "function".into(),
            function: FunctionDef {
                name,
                description,
                parameters,
                strict: None,
            },
        }
    }
}

impl ToolChoice {
    /// A call of the function `name`, forced.
    pub fn named(name: String) -> Self {
        Self::Named {
            kind: "function".into(),
            function: NamedFunction { name },
        }
    }
}

impl InToolCall {
    /// A call of the history as another API than OpenAI's spells one: its id, the function's
    /// name and its arguments as a JSON text.
    pub fn new(id: String, name: String, arguments: String) -> Self {
        Self {
            id,
            kind: None,
            function: InFunctionCall { name, arguments },
        }
    }

    /// The call as a message of a session keeps it.
    pub fn stored(&self) -> ToolCall {
        let f = &self.function;
        ToolCall::function(self.id.clone(), f.name.clone(), f.arguments.clone())
    }
}

/// A call in an assistant message of the history.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct InToolCall {
    /// The call's id, which the `tool` message answering it names.
    id: String,
    /// `function`
    #[serde(rename = "type", default)]
    #[allow(dead_code)]
    kind: Option<String>,
    function: InFunctionCall,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct InFunctionCall {
    name: String,
    /// The arguments as a JSON text (OpenAI's form).
    arguments: String,
}

/// What the request lets the model do with its tools.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum Choice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A request's tools, checked (and, as such, kept with a running reply's job for another
/// replica: see [`crate::service`]'s takeover).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tools {
    defs: Vec<FunctionDef>,
    choice: Choice,
}

fn refuse(field: &str, why: &str) -> ToolError {
    ToolError::Invalid(Invalid::field(field, why))
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

impl Tools {
    /// The request's `tools` and `tool_choice`, checked: `None` when it offers no tools.
    pub fn new(
        tools: Option<&[Tool]>,
        choice: Option<&ToolChoice>,
    ) -> Result<Option<Self>, ToolError> {
        let tools = tools.unwrap_or_default();
        if tools.is_empty() {
            return match choice {
                None => Ok(None),
                Some(ToolChoice::Mode(m)) if m == "none" || m == "auto" => Ok(None),
                Some(_) => Err(refuse("tool_choice", "needs `tools`")),
            };
        }
        if tools.len() > MAX_TOOLS {
            return Err(refuse("tools", &format!("at most {MAX_TOOLS}")));
        }
        let mut defs: Vec<FunctionDef> = Vec::with_capacity(tools.len());
        for (i, t) in tools.iter().enumerate() {
            defs.push(check_tool(i, t, &defs)?.clone());
        }
        let choice = parse_choice(choice, &defs)?;
        Ok(Some(Self { defs, choice }))
    }

    /// Whether the model may call a tool at all (`tool_choice` other than `none`).
    pub fn callable(&self) -> bool {
        self.choice != Choice::None
    }

    /// Whether the reply must be a call (and is constrained to one).
    pub fn forced(&self) -> bool {
        matches!(self.choice, Choice::Required | Choice::Named(_))
    }

    /// What the system prompt gains: the functions and the form of a call. Nothing with
    /// `tool_choice: none` (the model then answers in words, as if it had no tools). The text is
    /// the same for `auto`, `required` and a named function (a forced call is made by the
    /// grammar, not asked for in words), so a session's cached prompt survives a change of
    /// `tool_choice` between turns.
    pub fn system_text(&self) -> Option<String> {
        if !self.callable() {
            return None;
        }
        let mut s = String::from(
            "You can call functions. To call one, reply with nothing but a JSON object of this \
             form: {\"name\": \"<function name>\", \"parameters\": {<its arguments>}}. To call \
             several at once, reply with a JSON array of such objects. Each result comes back \
             in the next message.",
        );
        s.push_str("\nThe functions:");
        for d in &self.defs {
            s.push('\n');
            s.push_str(&serde_json::to_string(d).unwrap_or_default());
        }
        Some(s)
    }

    /// One call's schema: `{"name": <one of names>, "parameters": <its schema>}`. The tool's
    /// schema gets an `$id` of its own (unless it has one), so its references (Pydantic's
    /// `#/$defs/…`) resolve against it and not against the call around it.
    fn call_schema(d: &FunctionDef) -> Value {
        let mut params = d
            .parameters
            .clone()
            .unwrap_or_else(|| json!({"type": "object"}));
        if let Some(o) = params.as_object_mut() {
            o.entry("$id")
                .or_insert_with(|| json!(format!("urn:hearth:tool:{}", d.name)));
        }
        json!({
            "type": "object",
            "properties": {
                "name": {"const": d.name},
                "parameters": params,
            },
            "required": ["name", "parameters"],
            "additionalProperties": false,
        })
    }

    /// Each tool's parameters schema as a grammar, with the field that holds it: what compiles
    /// once the request is charged (`tools[i].function.parameters`).
    pub fn schemas(&self) -> Vec<(String, Grammar)> {
        (0..)
            .zip(&self.defs)
            .filter_map(|(i, d)| {
                let schema = d.parameters.clone()?;
                let field = format!("tools[{i}].function.parameters");
                Some((field, Grammar::JsonSchema { schema }))
            })
            .collect()
    }

    /// The grammar a forced call follows: the named function's call, or any tool's.
    pub fn grammar(&self) -> Option<Grammar> {
        let schema = match &self.choice {
            Choice::Named(n) => self
                .defs
                .iter()
                .find(|d| &d.name == n)
                .map(Self::call_schema)?,
            Choice::Required => {
                json!({"anyOf": self.defs.iter().map(Self::call_schema).collect::<Vec<_>>()})
            }
            Choice::None | Choice::Auto => return None,
        };
        Some(Grammar::JsonSchema { schema })
    }

    /// The calls `text` makes, if it is nothing but calls of known tools (a JSON object or an
    /// array of them, optionally in a code fence); `None` if it is an answer in words.
    pub fn calls(&self, text: &str) -> Option<Vec<ToolCall>> {
        if !self.callable() {
            return None;
        }
        let body = strip_fence(text.trim());
        let v: Value = serde_json::from_str(body).ok()?;
        let items = match v {
            // More calls than a turn may answer would leave the exchange stuck: words, then.
            Value::Array(a) if !a.is_empty() && a.len() <= MAX_CALLS => a,
            o @ Value::Object(_) => vec![o],
            _ => return None,
        };
        items
            .into_iter()
            .map(|item| {
                let name = item.get("name")?.as_str()?;
                self.defs.iter().find(|d| d.name == name)?;
                let args = item
                    .get("parameters")
                    .or_else(|| item.get("arguments"))
                    .cloned()
                    .unwrap_or_else(|| json!({}));
                let id = format!("call_{}", &uuid::Uuid::new_v4().simple().to_string()[..24]);
                args.is_object()
                    .then(|| ToolCall::function(id, name.to_string(), args.to_string()))
            })
            .collect()
    }

    /// Whether `text`, the start of a reply, may still become a call (so a stream holds it back
    /// rather than sending it as words).
    pub fn may_be_call(&self, text: &str) -> bool {
        if self.forced() {
            return true;
        }
        if !self.callable() {
            return false;
        }
        let t = text.trim_start();
        t.is_empty()
            || t.starts_with('{')
            || t.starts_with('[')
            || "```".starts_with(t)
            || t.starts_with("```")
    }
}

/// A streamed reply's text, held back while it may still become calls of the request's tools,
/// so that a stream never shows as words what ends as a call (every API streams this way).
#[derive(Debug, Default)]
pub struct HeldText {
    /// The request's tools, when the model may call them.
    tools: Option<std::sync::Arc<Tools>>,
    /// What is held; `None` once the reply cannot be a call, or without tools.
    held: Option<String>,
}

impl HeldText {
    pub fn new(tools: Option<std::sync::Arc<Tools>>) -> Self {
        let tools = tools.filter(|t| t.callable());
        Self {
            held: tools.as_ref().map(|_| String::new()),
            tools,
        }
    }

    /// The text to show for the reply's next piece `t`: `t` after what was held, once the
    /// reply can no longer be a call; `None` while it still may.
    pub fn pass(&mut self, t: String) -> Option<String> {
        let (Some(held), Some(tools)) = (&mut self.held, &self.tools) else {
            return Some(t);
        };
        held.push_str(&t);
        if tools.may_be_call(held) {
            return None;
        }
        self.held.take()
    }

    /// At the reply's end: its whole text if it was held all along (it may be calls).
    pub fn take(&mut self) -> Option<String> {
        self.held.take()
    }
}

/// Tool `i` of a request, checked: a function with a valid name not offered before (in `defs`)
/// and, if it has parameters, a JSON Schema object of a shape the grammar engine takes.
fn check_tool<'a>(
    i: usize,
    t: &'a Tool,
    defs: &[FunctionDef],
) -> Result<&'a FunctionDef, ToolError> {
    let field = format!("tools[{i}]");
    if t.kind != "function" {
        return Err(refuse(&format!("{field}.type"), "only `function`"));
    }
    let f = &t.function;
    if !valid_name(&f.name) {
        return Err(refuse(
            &format!("{field}.function.name"),
            "1 to 64 letters, digits, `_` or `-`",
        ));
    }
    if defs.iter().any(|d| d.name == f.name) {
        return Err(refuse(
            &format!("{field}.function.name"),
            &format!("`{}` is offered twice", f.name),
        ));
    }
    if let Some(p) = &f.parameters {
        let params = format!("{field}.function.parameters");
        if !p.is_object() {
            return Err(refuse(&params, "must be a JSON Schema object"));
        }
        // Only its shape here: the compile waits for the request's charge (see
        // [`Tools::schemas`]).
        let g = Grammar::JsonSchema { schema: p.clone() };
        g.check_shape()
            .map_err(|e| ToolError::InvalidGrammar(Invalid::field(params, e.to_string())))?;
    }
    Ok(f)
}

/// A request's `tool_choice` (auto when absent), a named function among `defs`.
fn parse_choice(choice: Option<&ToolChoice>, defs: &[FunctionDef]) -> Result<Choice, ToolError> {
    Ok(match choice {
        None => Choice::Auto,
        Some(ToolChoice::Mode(m)) => match m.as_str() {
            "none" => Choice::None,
            "auto" => Choice::Auto,
            "required" => Choice::Required,
            other => {
                return Err(refuse(
                    "tool_choice",
                    &format!("`{other}` is not one of none, auto, required"),
                ))
            }
        },
        Some(ToolChoice::Named { kind, function }) => {
            if kind != "function" {
                return Err(refuse("tool_choice.type", "only `function`"));
            }
            if !defs.iter().any(|d| d.name == function.name) {
                return Err(refuse(
                    "tool_choice.function.name",
                    &format!("`{}` is not among the tools", function.name),
                ));
            }
            Choice::Named(function.name.clone())
        }
    })
}

/// `text` without a surrounding Markdown code fence (```` ``` ```` or ```` ```json ````).
fn strip_fence(text: &str) -> &str {
    let Some(inner) = text.strip_prefix("```").and_then(|t| t.strip_suffix("```")) else {
        return text;
    };
    let inner = inner.trim_start_matches(|c: char| c.is_ascii_alphanumeric() || c == '_');
    inner.trim()
}

/// An assistant message of the history: its text, then its calls written as the model writes
/// them.
pub fn assistant_text(
    field: &str,
    content: String,
    calls: Option<&[InToolCall]>,
) -> Result<String, ToolError> {
    let Some(calls) = calls.filter(|c| !c.is_empty()) else {
        return Ok(content);
    };
    let mut rendered = Vec::with_capacity(calls.len());
    for (j, c) in calls.iter().enumerate() {
        let args: Value = serde_json::from_str(&c.function.arguments).map_err(|e| {
            refuse(
                &format!("{field}.tool_calls[{j}].function.arguments"),
                &format!("not JSON: {e}"),
            )
        })?;
        rendered.push(json!({"name": c.function.name, "parameters": args}));
    }
    let call = match rendered.as_slice() {
        [one] => one.to_string(),
        _ => Value::Array(rendered).to_string(),
    };
    Ok(if content.trim().is_empty() {
        call
    } else {
        format!("{content}\n\n{call}")
    })
}

/// A `tool` message of the history: a user turn that names the function whose result it holds
/// (`earlier`: the calls made before it, as (id, name)).
pub fn tool_text(
    field: &str,
    content: &str,
    call_id: Option<&str>,
    earlier: &[(String, String)],
) -> Result<String, ToolError> {
    let id = call_id.ok_or_else(|| refuse(&format!("{field}.tool_call_id"), "required"))?;
    let name = earlier
        .iter()
        .find(|(cid, _)| cid == id)
        .map(|(_, n)| n.as_str())
        .ok_or_else(|| {
            refuse(
                &format!("{field}.tool_call_id"),
                &format!("`{id}` names no earlier tool call"),
            )
        })?;
    Ok(result_text(name, content))
}

/// How a tool's result reads to the model: a user turn that names the function.
pub fn result_text(name: &str, content: &str) -> String {
    format!("Result of `{name}`:\n{content}")
}

/// The grammar a turn follows, and the field that gave it: a forced call's (`tool_choice`), or
/// the one the request asked for (named `field`). Both at once is an error.
pub fn turn_grammar<'a>(
    tools: Option<&Tools>,
    field: &'a str,
    grammar: Option<Grammar>,
) -> Result<(&'a str, Option<Grammar>), ToolError> {
    match (tools.and_then(Tools::grammar), grammar) {
        (Some(_), Some(_)) => Err(refuse(
            "tool_choice",
            "a required call is not compatible with a response_format or grammar",
        )),
        (Some(call), None) => Ok(("tool_choice", Some(call))),
        (None, g) => Ok((field, g)),
    }
}

/// The calls an assistant message makes, as (id, function name), for the tool messages after it.
pub fn call_names(calls: Option<&[InToolCall]>) -> Vec<(String, String)> {
    calls
        .unwrap_or_default()
        .iter()
        .map(|c| (c.id.clone(), c.function.name.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(choice: Option<Value>) -> Result<Option<Tools>, ToolError> {
        let t: Vec<Tool> = serde_json::from_value(json!([
            {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}},
            {"type": "function", "function": {"name": "now"}}
        ]))
        .expect("tools");
        let c: Option<ToolChoice> = choice.map(|c| serde_json::from_value(c).expect("choice"));
        Tools::new(Some(&t), c.as_ref())
    }

    #[test]
    fn a_streamed_reply_is_held_while_it_may_be_a_call() {
        let auto = tools(None).expect("ok").map(std::sync::Arc::new);
        let mut h = HeldText::new(auto.clone());
        assert_eq!(h.pass(" {\"na".into()), None);
        assert_eq!(h.pass("me\": \"now\"}".into()), None);
        assert_eq!(h.take().as_deref(), Some(" {\"name\": \"now\"}"));
        // Words: released, with what was held, as soon as they cannot be a call.
        let mut h = HeldText::new(auto);
        assert_eq!(h.pass(" ".into()), None);
        assert_eq!(h.pass("It is".into()).as_deref(), Some(" It is"));
        assert_eq!(h.pass(" sunny".into()).as_deref(), Some(" sunny"));
        assert_eq!(h.take(), None);
        // Without callable tools nothing is held.
        let none = tools(Some(json!("none")))
            .expect("ok")
            .map(std::sync::Arc::new);
        let mut h = HeldText::new(none);
        assert_eq!(h.pass("{".into()).as_deref(), Some("{"));
        assert_eq!(HeldText::new(None).pass("[".into()).as_deref(), Some("["));
    }

    #[test]
    fn replies_that_are_calls_of_known_tools_become_calls() {
        let t = tools(None).expect("ok").expect("some");
        let one = t
            .calls(r#"{"name": "get_weather", "parameters": {"city": "Oslo"}}"#)
            .expect("a call");
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].function.name, "get_weather");
        assert_eq!(one[0].function.arguments, r#"{"city":"Oslo"}"#);
        assert!(one[0].id.starts_with("call_") && one[0].id.len() == 29);
        let fenced = "```json\n[{\"name\": \"now\"}, {\"name\": \"get_weather\", \"arguments\": {\"city\": \"A\"}}]\n```";
        assert_eq!(t.calls(fenced).expect("two").len(), 2);
        for words in [
            "It is sunny.",
            r#"{"name": "unknown", "parameters": {}}"#,
            r#"{"name": "now", "parameters": 3}"#,
            "[]",
        ] {
            assert!(t.calls(words).is_none(), "{words}");
        }
        assert!(t.may_be_call("  {\"na") && t.may_be_call("``") && !t.may_be_call("It"));
        // As many calls as a turn may answer, and no more.
        let many = |n: usize| format!("[{}]", vec![r#"{"name": "now"}"#; n].join(","));
        assert_eq!(t.calls(&many(MAX_CALLS)).map(|c| c.len()), Some(MAX_CALLS));
        assert!(t.calls(&many(MAX_CALLS + 1)).is_none());
    }

    #[test]
    fn choices_are_checked_and_forced_ones_constrain_the_reply() {
        assert!(tools(None).expect("ok").expect("some").grammar().is_none());
        let named = tools(Some(
            json!({"type": "function", "function": {"name": "now"}}),
        ))
        .expect("ok")
        .expect("some");
        let Some(Grammar::JsonSchema { schema }) = named.grammar() else {
            panic!("a schema");
        };
        assert_eq!(schema["properties"]["name"]["const"], "now");
        named.grammar().expect("g").check().expect("compiles");
        let required = tools(Some(json!("required"))).expect("ok").expect("some");
        required.grammar().expect("g").check().expect("compiles");
        assert!(required
            .system_text()
            .expect("text")
            .contains("get_weather"));
        // The prompt does not change with the choice (a session's cache survives it).
        let auto = tools(None).expect("ok").expect("some");
        assert_eq!(auto.system_text(), required.system_text());
        assert_eq!(auto.system_text(), named.system_text());
        let none = tools(Some(json!("none"))).expect("ok").expect("some");
        assert!(none.system_text().is_none() && none.calls(r#"{"name": "now"}"#).is_none());
        for bad in [
            json!("sometimes"),
            json!({"type": "function", "function": {"name": "x"}}),
        ] {
            assert!(matches!(tools(Some(bad)), Err(ToolError::Invalid(_))));
        }
        let c: ToolChoice = serde_json::from_value(json!("required")).expect("choice");
        assert!(
            Tools::new(None, Some(&c)).is_err(),
            "a choice without tools"
        );
        let bad_schema: Vec<Tool> = serde_json::from_value(json!([{"type": "function",
            "function": {"name": "f", "parameters": {"type": "objekt"}}}]))
        .expect("tools");
        // Offered, its schema's compile is left for later, and fails naming its field.
        let offered = Tools::new(Some(&bad_schema), None)
            .expect("ok")
            .expect("some");
        let [(field, g)] = offered.schemas().try_into().expect("one schema");
        assert_eq!(field, "tools[0].function.parameters");
        assert!(g.check().is_err());
        let not_a_schema: Vec<Tool> = serde_json::from_value(json!([{"type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "x": "y".repeat(70_000)}}}]))
        .expect("tools");
        assert!(matches!(
            Tools::new(Some(&not_a_schema), None),
            Err(ToolError::InvalidGrammar(m)) if m.param.as_deref() == Some("tools[0].function.parameters")
        ));
    }

    #[test]
    fn a_forced_call_keeps_the_tools_own_references() {
        // Pydantic's form: definitions in `$defs`, referred to from the root of the schema.
        let t: Vec<Tool> = serde_json::from_value(json!([{"type": "function", "function": {
            "name": "ship", "parameters": {
                "$defs": {"Addr": {"type": "object", "properties": {"city": {"type": "string"}},
                                   "required": ["city"]}},
                "type": "object", "properties": {"to": {"$ref": "#/$defs/Addr"}},
                "required": ["to"]}}}]))
        .expect("tools");
        for choice in [
            json!("required"),
            json!({"type": "function", "function": {"name": "ship"}}),
        ] {
            let c: ToolChoice = serde_json::from_value(choice).expect("choice");
            let tools = Tools::new(Some(&t), Some(&c)).expect("ok").expect("some");
            let g = tools.grammar().expect("a grammar");
            g.check().unwrap_or_else(|e| panic!("{e}"));
        }
    }

    #[test]
    fn history_calls_and_results_render_as_turns() {
        let calls: Vec<InToolCall> =
            serde_json::from_value(json!([{"id": "call_1", "type": "function",
            "function": {"name": "now", "arguments": "{}"}}]))
            .expect("calls");
        let text = assistant_text("messages[1]", String::new(), Some(&calls)).expect("ok");
        assert_eq!(text, r#"{"name":"now","parameters":{}}"#);
        let earlier = call_names(Some(&calls));
        let text = tool_text("messages[2]", "12:00", Some("call_1"), &earlier).expect("ok");
        assert_eq!(text, "Result of `now`:\n12:00");
        let e = tool_text("messages[2]", "x", Some("call_9"), &earlier);
        assert!(
            matches!(e, Err(ToolError::Invalid(m)) if m.param.as_deref() == Some("messages[2].tool_call_id"))
        );
    }
}
