//! `hearth-worker chat`: a terminal chat over the engine, one session whose KV cache is reused
//! from turn to turn. The orchestrator will own templating; this is the minimal Gemma template.
#![allow(clippy::print_stdout)]

use std::io::{BufRead, Write};
use std::path::Path;
use std::sync::Arc;

use hearth_shared::tokenizer::Tokenizer;
use hearth_shared::{SamplingParams, SessionId};
use hearth_worker::engine::{Engine, EngineConfig, EngineEvent, GenerateRequest};
use hearth_worker::model::load_gguf;

/// Fails with the file's name and the command that fetches it.
pub fn require_file(path: &Path) -> anyhow::Result<()> {
    if path.is_file() {
        Ok(())
    } else {
        anyhow::bail!("model file {} not found; run `scripts/fetch-model.sh` (or `make fetch-model`) to fetch it", path.display())
    }
}

pub fn chat(
    model: &Path,
    tokenizer: &Path,
    max_new_tokens: u32,
    temperature: f32,
) -> anyhow::Result<()> {
    require_file(model)?;
    require_file(tokenizer)?;
    let tok = Tokenizer::from_file(tokenizer)?;
    let model = Arc::new(load_gguf(model)?);
    let engine = Engine::start(
        model,
        EngineConfig {
            kv_budget_bytes: 512 << 20,
            ..Default::default()
        },
    )?;
    let h = engine.handle();
    let params = SamplingParams {
        temperature,
        ..Default::default()
    };
    params.validate()?;
    let mut history: Vec<u32> = vec![tok.bos_id];
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    println!("hearth chat: type a message and press enter (Ctrl-D to quit)");
    for (turn, line) in stdin.lock().lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        history.extend(tok.encode(&format!(
            "<start_of_turn>user\n{line}<end_of_turn>\n<start_of_turn>model\n"
        ))?);
        let mut req = GenerateRequest::new(turn as u64, history.clone(), max_new_tokens);
        req.session = Some(SessionId::from("terminal"));
        req.params = params.clone();
        let mut rx = h.submit(req)?;
        let mut reply = Vec::new();
        let mut printed = 0;
        while let Some(ev) = rx.blocking_recv() {
            match ev {
                EngineEvent::Token { id, .. } => {
                    reply.push(id);
                    // Print only whole characters: decode everything and emit the new suffix.
                    let text = tok.decode(&reply)?;
                    if !text.ends_with('\u{FFFD}') && text.len() > printed {
                        print!("{}", &text[printed..]);
                        printed = text.len();
                        out.flush()?;
                    }
                }
                EngineEvent::Finished {
                    cached_tokens,
                    completion_tokens,
                    timings,
                    ..
                } => {
                    println!("\n[{completion_tokens} tokens, {cached_tokens} prompt tokens from cache, first token after {:.0} ms]", timings.time_to_first_token_ms);
                    break;
                }
                EngineEvent::Error(e) => anyhow::bail!("generation failed: {e}"),
                EngineEvent::Started { .. } => {}
            }
        }
        history.extend(&reply);
        history.extend(tok.encode("<end_of_turn>\n")?);
    }
    Ok(())
}
