//! Constrained decoding: a sequence with a grammar samples each token from those the grammar
//! allows next.
//!
//! The grammar engine is llguidance. A [`Grammars`] holds its parser factory over the model's
//! vocabulary and a few mask threads. The factory takes a second or more to build over a 262k
//! vocabulary, so it is built on a thread of its own while the worker starts serving; only a
//! constrained request that arrives before it is ready waits for it.
//!
//! Each constrained sequence holds a [`Constraint`]: its matcher and the mask of its next step,
//! computed on a mask thread while the forward pass runs. The sequence's token is known as soon
//! as it is sampled, so the next step's mask (the matcher consumes the token, then computes which tokens may follow) is ready
//! by the time that step's logits are, and the engine thread only waits for it when the
//! forward pass was faster than the mask. The mask threads take their work from each user in
//! turn ([`super::mask_queue`]): one user's many constrained sequences do not hold up another's.
//! Each constraint knows how late its masks come ([`Constraint::lateness`]), so that the
//! scheduler can keep a grammar slower than the forward pass from holding up other sequences.

use std::path::Path;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use hearth_shared::Grammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

use super::mask_queue::{FairQueue, Job};
use super::EngineError;

/// llama.cpp's token types, as GGUF files store them.
const TYPE_UNKNOWN: i32 = 2;
const TYPE_CONTROL: i32 = 3;
const TYPE_UNUSED: i32 = 5;
const TYPE_BYTE: i32 = 6;

/// Each token's bytes as the grammar engine sees them: text tokens as their UTF-8 (`▁` as a
/// space), byte tokens as their byte, and control tokens marked special (llguidance's `0xFF`
/// prefix), which no grammar matches as text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vocabulary(Vec<Vec<u8>>);

impl Vocabulary {
    /// From SentencePiece pieces and (where the file has them) their token types.
    pub fn from_pieces(pieces: &[String], types: Option<&[i32]>) -> Self {
        let bytes = pieces
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let ty = types.and_then(|t| t.get(i).copied());
                piece_bytes(p, ty)
            })
            .collect();
        Self(bytes)
    }

    /// The vocabulary a GGUF file's `tokenizer.ggml.*` metadata holds (only its header is read).
    pub fn from_gguf(path: &Path) -> Result<Self, String> {
        use candle_core::quantized::gguf_file::{Content, Value};
        let mut f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let content = Content::read(&mut f).map_err(|e| format!("{}: {e}", path.display()))?;
        let md = &content.metadata;
        let pieces: Vec<String> = match md.get("tokenizer.ggml.tokens").map(Value::to_vec) {
            Some(Ok(v)) => v
                .iter()
                .map(|t| t.to_string().cloned().unwrap_or_default())
                .collect(),
            _ => return Err("the model file has no tokenizer.ggml.tokens".into()),
        };
        let types: Option<Vec<i32>> = md
            .get("tokenizer.ggml.token_type")
            .and_then(|v| v.to_vec().ok())
            .map(|v| v.iter().map(|t| t.to_i32().unwrap_or(1)).collect());
        Ok(Self::from_pieces(&pieces, types.as_deref()))
    }

    /// The vocabulary of a `tokenizer.json` (a checkpoint directory's).
    pub fn from_tokenizer_json(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        llguidance::token_bytes_from_tokenizer_json(&json)
            .map(Self)
            .map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// One piece's bytes. Without token types, `<0xHH>` is a byte and any other `<…>` piece a
/// control token, as in Gemma's vocabulary.
fn piece_bytes(piece: &str, ty: Option<i32>) -> Vec<u8> {
    let byte = piece
        .strip_prefix("<0x")
        .and_then(|h| h.strip_suffix('>'))
        .filter(|h| h.len() == 2)
        .and_then(|h| u8::from_str_radix(h, 16).ok());
    let special = |p: &str| {
        let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
        b.extend_from_slice(p.as_bytes());
        b
    };
    match (ty, byte) {
        (Some(TYPE_BYTE) | None, Some(b)) => vec![b],
        (Some(TYPE_CONTROL | TYPE_UNKNOWN | TYPE_UNUSED), _) => special(piece),
        (None, None) if piece.len() > 2 && piece.starts_with('<') && piece.ends_with('>') => {
            special(piece)
        }
        _ => piece.replace('▁', " ").into_bytes(),
    }
}

/// The grammar engine over one model's vocabulary, and the threads that compute masks (a
/// constrained sequence's next mask is computed on one of them while the forward pass runs).
pub struct Grammars {
    /// Set by the thread that builds it ([`Grammars::new`]).
    factory: Arc<OnceLock<Result<ParserFactory, String>>>,
    jobs: Arc<FairQueue>,
}

impl Drop for Grammars {
    /// Stops the mask threads; a sequence still waiting for a mask is told.
    fn drop(&mut self) {
        self.jobs.close();
    }
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").finish_non_exhaustive()
    }
}

impl Grammars {
    /// The engine over `model`'s `vocab`, whose end-of-sequence tokens are the model's stop
    /// tokens (EOS and `<end_of_turn>`), with `threads` mask threads.
    pub fn for_model(
        vocab: Vocabulary,
        model: &super::Weights,
        threads: usize,
    ) -> Result<Self, String> {
        let (_, eos, end_of_turn) = model.special();
        let stops: Vec<u32> = [eos, end_of_turn].into_iter().flatten().collect();
        Self::new(vocab, &stops, model.config().vocab_size, threads)
    }

    /// The engine over `vocab`, whose end-of-sequence tokens are `eos` (the model's stop
    /// tokens: a grammar that is complete lets the model end its turn with any of them), with
    /// `threads` mask threads. The parser factory is built in the background.
    pub fn new(
        vocab: Vocabulary,
        eos: &[u32],
        model_vocab: usize,
        threads: usize,
    ) -> Result<Self, String> {
        if vocab.is_empty() || vocab.len() > model_vocab {
            return Err(format!(
                "the vocabulary has {} tokens, the model {model_vocab} rows of logits",
                vocab.len()
            ));
        }
        let first_eos = *eos.first().ok_or("the model names no stop token")?;
        if let Some(e) = eos.iter().find(|&&e| e as usize >= vocab.len()) {
            return Err(format!(
                "stop token {e} is outside the vocabulary of {}",
                vocab.len()
            ));
        }
        let factory = Arc::new(OnceLock::new());
        let (slot, eos) = (factory.clone(), eos.to_vec());
        std::thread::Builder::new()
            .name("hearth-grammar-init".into())
            .spawn(move || {
                let _ = slot.set(build_factory(&vocab, first_eos, &eos));
            })
            .map_err(|e| format!("cannot start the grammar engine's thread: {e}"))?;
        let jobs = Arc::new(FairQueue::default());
        for i in 0..threads.max(1) {
            let queue = jobs.clone();
            let started = std::thread::Builder::new()
                .name(format!("hearth-mask-{i}"))
                .spawn(move || {
                    while let Some(job) = queue.pop() {
                        job();
                    }
                });
            if let Err(e) = started {
                jobs.close();
                return Err(format!("cannot start a mask thread: {e}"));
            }
        }
        Ok(Self { factory, jobs })
    }

    /// Queues `job` on the mask threads as `user`'s.
    #[cfg(test)]
    pub(crate) fn push_job(&self, user: &str, job: Job) {
        self.jobs.push(user, job);
    }

    /// Waits until the parser factory is built; its error if it could not be.
    pub fn ready(&self) -> Result<&ParserFactory, String> {
        self.factory.wait().as_ref().map_err(Clone::clone)
    }

    /// Compiles `grammar` for a sequence of `user` whose reply so far is `reply` (a
    /// continuation's tokens, or none), and starts computing its first mask.
    pub(crate) fn start(
        &self,
        grammar: &Grammar,
        reply: &[u32],
        user: &str,
    ) -> Result<Constraint, EngineError> {
        let parser = self
            .ready()
            .map_err(|e| EngineError::InvalidGrammar(format!("the grammar engine failed: {e}")))?
            .create_parser(grammar.to_llguidance())
            .map_err(|e| EngineError::InvalidGrammar(e.to_string()))?;
        let mut matcher = Matcher::new(Ok(parser));
        matcher.consume_tokens(reply).map_err(|e| {
            EngineError::InvalidGrammar(format!("the reply so far does not follow it: {e}"))
        })?;
        let mut c = Constraint {
            matcher: Arc::new(Mutex::new(matcher)),
            next: None,
            ready: None,
            jobs: self.jobs.clone(),
            user: user.to_string(),
            asked: Instant::now(),
            latency: Duration::ZERO,
        };
        c.request(None);
        Ok(c)
    }
}

/// llguidance's parser factory over `vocab`.
fn build_factory(vocab: &Vocabulary, first_eos: u32, eos: &[u32]) -> Result<ParserFactory, String> {
    let info = TokRxInfo::new(vocab.len() as u32, first_eos);
    let trie = TokTrie::from(&info, &vocab.0).with_eos_tokens(eos);
    let env: llguidance::toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
    let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
    factory.quiet();
    Ok(factory)
}

/// What a constrained sequence may do next.
#[derive(Debug)]
pub(crate) enum Next {
    /// Sample among the tokens this mask allows.
    Mask(SimpleVob),
    /// The grammar is complete and nothing can follow: the reply ends here.
    Done,
    /// The grammar engine failed (a grammar that exceeds its limits, say).
    Failed(String),
}

/// A mask, and when its thread finished it.
type Computed = (Next, Instant);

/// A sequence's matcher and its next step's mask, computed off the engine thread.
pub(crate) struct Constraint {
    matcher: Arc<Mutex<Matcher>>,
    next: Option<Receiver<Computed>>,
    /// The next step's mask once it arrived and was looked at, not yet used.
    ready: Option<Next>,
    jobs: Arc<FairQueue>,
    /// Whose sequence it is: the mask threads serve users in turn.
    user: String,
    /// When the latest mask was asked for.
    asked: Instant,
    /// How long the latest mask that arrived took from being asked for, queueing included.
    latency: Duration,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("pending", &self.next.is_some())
            .field("ready", &self.ready.is_some())
            .finish_non_exhaustive()
    }
}

impl Constraint {
    /// Feeds the sampled `token` to the matcher and starts computing the next mask.
    pub(crate) fn advance(&mut self, token: u32) {
        self.request(Some(token));
    }

    fn request(&mut self, token: Option<u32>) {
        let (tx, rx) = channel();
        let matcher = self.matcher.clone();
        let job: Job = Box::new(move || {
            // A panic in the grammar engine fails this sequence, not the mask thread.
            let next = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                next_mask(&matcher, token)
            }))
            .unwrap_or_else(|_| Next::Failed("the grammar engine panicked".into()));
            let _ = tx.send((next, Instant::now()));
        });
        self.asked = Instant::now();
        // Dropped (with `tx`) once the mask threads are gone; `wait` then reports it.
        self.jobs.push(&self.user, job);
        self.next = Some(rx);
    }

    /// Takes a mask that arrived.
    fn arrived(&mut self, (next, at): Computed) -> Next {
        self.next = None;
        self.latency = at.saturating_duration_since(self.asked);
        next
    }

    /// How late this grammar's masks come: the time the latest one took, or the time the one
    /// still being computed has taken so far, whichever is longer.
    pub(crate) fn lateness(&mut self) -> Duration {
        self.poll();
        if self.next.is_some() {
            self.latency.max(self.asked.elapsed())
        } else {
            self.latency
        }
    }

    /// Takes the next mask if it has arrived (or its thread is gone), without waiting.
    fn poll(&mut self) {
        if self.ready.is_some() {
            return;
        }
        let n = match self.next.as_ref().map(Receiver::try_recv) {
            Some(Ok(n)) => self.arrived(n),
            Some(Err(TryRecvError::Disconnected)) => Next::Failed("the mask thread is gone".into()),
            Some(Err(TryRecvError::Empty)) | None => return,
        };
        self.next = None;
        self.ready = Some(n);
    }

    /// Whether the grammar is known to be complete with nothing to follow, without waiting:
    /// the sequence can end before its next step runs.
    pub(crate) fn done_now(&mut self) -> bool {
        self.poll();
        matches!(self.ready, Some(Next::Done))
    }

    /// Whether [`Constraint::wait`] would answer at once: the next mask has arrived, or none is
    /// coming (its thread is gone, or none was asked for).
    pub(crate) fn mask_ready(&mut self) -> bool {
        self.poll();
        self.ready.is_some() || self.next.is_none()
    }

    /// Feeds the reply's last `token` to the matcher here, computing no mask: whether it
    /// completed the grammar with nothing to follow. Cheap next to a mask, so a reply that
    /// ends holds up no step waiting for one.
    pub(crate) fn ends_with(&mut self, token: u32) -> bool {
        let Ok(mut m) = self.matcher.lock() else {
            return false;
        };
        m.consume_token(token).is_ok() && m.is_stopped()
    }

    /// The next step's mask, waiting for it if it is still being computed.
    pub(crate) fn wait(&mut self) -> Next {
        if let Some(n) = self.ready.take() {
            return n;
        }
        match self.next.as_ref().map(Receiver::recv) {
            Some(Ok(n)) => self.arrived(n),
            Some(Err(_)) => {
                self.next = None;
                Next::Failed("the mask thread is gone".into())
            }
            None => Next::Failed("no mask was requested".into()),
        }
    }

    /// [`Constraint::wait`] for at most `grace`: none if the mask is not there by then.
    pub(crate) fn wait_for(&mut self, grace: Duration) -> Option<Next> {
        if let Some(n) = self.ready.take() {
            return Some(n);
        }
        match self.next.as_ref().map(|rx| rx.recv_timeout(grace)) {
            Some(Ok(n)) => Some(self.arrived(n)),
            Some(Err(RecvTimeoutError::Timeout)) => None,
            Some(Err(RecvTimeoutError::Disconnected)) => {
                self.next = None;
                Some(Next::Failed("the mask thread is gone".into()))
            }
            None => Some(Next::Failed("no mask was requested".into())),
        }
    }
}

fn next_mask(matcher: &Mutex<Matcher>, token: Option<u32>) -> Next {
    let Ok(mut m) = matcher.lock() else {
        return Next::Failed("the matcher is poisoned".into());
    };
    if let Some(t) = token {
        if let Err(e) = m.consume_token(t) {
            return Next::Failed(first_line(&e.to_string()));
        }
    }
    if let Some(e) = m.get_error() {
        return Next::Failed(first_line(&e));
    }
    if m.is_stopped() {
        return Next::Done;
    }
    match m.compute_mask() {
        // Tokens past the vocabulary (rows the model has and the vocabulary lacks) are never
        // allowed: `apply_mask` masks whatever the mask's words do not cover.
        Ok(mask) if !mask.is_zero() => Next::Mask(mask),
        Ok(_) => Next::Failed("the grammar allows no token here".into()),
        Err(e) => Next::Failed(first_line(&e.to_string())),
    }
}

/// The grammar engine's errors carry its whole state after the first line; clients get the
/// first.
fn first_line(e: &str) -> String {
    e.lines().next().unwrap_or_default().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::apply_mask;

    /// Single ASCII characters, a few words, Gemma-like specials.
    fn vocab() -> (Vocabulary, Vec<u32>) {
        let mut pieces: Vec<String> = vec!["<pad>".into(), "<eos>".into(), "<bos>".into()];
        pieces.extend((0x20u8..0x7f).map(|c| (c as char).to_string().replace(' ', "▁")));
        pieces.extend(["▁yes", "no", "{\"", "<0x0A>", "<end_of_turn>"].map(String::from));
        let eot = pieces.len() as u32 - 1;
        (Vocabulary::from_pieces(&pieces, None), vec![1, eot])
    }

    fn id(v: &Vocabulary, text: &[u8]) -> u32 {
        v.0.iter().position(|t| t == text).expect("token") as u32
    }

    fn mask(c: &mut Constraint) -> SimpleVob {
        match c.wait() {
            Next::Mask(m) => m,
            other => panic!("no mask: {other:?}"),
        }
    }

    #[test]
    fn pieces_become_bytes_and_control_tokens_are_special() {
        let (v, _) = vocab();
        assert_eq!(v.0[1], b"\xFF<eos>");
        assert_eq!(v.0[id(&v, b" yes") as usize], b" yes");
        assert_eq!(id(&v, b"\n"), v.len() as u32 - 2);
        let typed = Vocabulary::from_pieces(
            &["<0x41>".into(), "<tool>".into(), "<b>".into()],
            Some(&[TYPE_BYTE, TYPE_CONTROL, 4]),
        );
        assert_eq!(
            typed.0,
            vec![b"A".to_vec(), b"\xFF<tool>".to_vec(), b"<b>".to_vec()]
        );
    }

    #[test]
    fn masks_follow_the_grammar_and_end_it() {
        let (v, eos) = vocab();
        let g = Grammars::new(v.clone(), &eos, v.len() + 5, 1).expect("grammars");
        let regex = Grammar::Regex {
            pattern: "(yes|no)!".into(),
        };
        let mut c = g.start(&regex, &[], "u").expect("compile");
        let m = mask(&mut c);
        let mut logits = vec![1.0f32; v.len() + 5];
        apply_mask(&m, &mut logits);
        let allowed: Vec<u32> = (0..logits.len() as u32)
            .filter(|&t| logits[t as usize] > 0.0)
            .collect();
        let expect = [id(&v, b"y"), id(&v, b"n"), id(&v, b"no")];
        let mut expect = expect.to_vec();
        expect.sort_unstable();
        assert_eq!(allowed, expect, "and never the rows past the vocabulary");
        c.advance(id(&v, b"no"));
        let m = mask(&mut c);
        assert!(m.is_allowed(id(&v, b"!")) && m.num_set() == 1);
        c.advance(id(&v, b"!"));
        // Complete, and nothing can follow.
        assert!(matches!(c.wait(), Next::Done));

        let mut logits = vec![1.0f32; v.len() + 5];
        let mut c = g.start(&regex, &[id(&v, b"y")], "u").expect("continuation");
        let m = mask(&mut c);
        apply_mask(&m, &mut logits);
        let live: Vec<usize> = (0..logits.len()).filter(|&i| logits[i] > 0.0).collect();
        assert_eq!(live, vec![id(&v, b"e") as usize]);
    }

    #[test]
    fn a_complete_grammar_ends_the_reply_or_lets_the_model_end_it() {
        let (v, eos) = vocab();
        let g = Grammars::new(v.clone(), &eos, v.len(), 1).expect("grammars");
        // A JSON object: once closed, nothing can follow (no trailing whitespace).
        let mut c = g.start(&Grammar::JsonObject, &[], "u").expect("compile");
        for t in [b"{".as_slice(), b"}"] {
            let m = mask(&mut c);
            assert!(m.is_allowed(id(&v, t)), "{t:?}");
            assert!(!m.is_allowed(eos[1]));
            c.advance(id(&v, t));
        }
        assert!(matches!(c.wait(), Next::Done));
        // Digits: complete after one, and more may follow, so the model may end its turn with
        // either stop token or go on.
        let digits = Grammar::Regex {
            pattern: "[0-9]+".into(),
        };
        let mut c = g.start(&digits, &[id(&v, b"7")], "u").expect("compile");
        let m = mask(&mut c);
        assert!(m.is_allowed(eos[0]) && m.is_allowed(eos[1]) && m.is_allowed(id(&v, b"3")));
        assert!(!m.is_allowed(id(&v, b"x")));
        let wrong = g.start(&Grammar::JsonObject, &[id(&v, b"x")], "u");
        assert!(matches!(wrong, Err(EngineError::InvalidGrammar(_))));
    }
}
