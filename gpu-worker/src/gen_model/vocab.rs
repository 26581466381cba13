//! A made-up SentencePiece vocabulary of any size, laid out as Gemma's: the control tokens at
//! Gemma's ids (`<pad>` 0, `<eos>` 1, `<bos>` 2, `<unk>` 3, `<mask>` 4, `<start_of_turn>` 105,
//! `<end_of_turn>` 106, `<unusedN>` between), the 256 byte tokens `<0x00>`…`<0xFF>`, then distinct
//! word pieces. llama.cpp's SentencePiece loader needs the byte tokens (it looks up `<0x0A>` for
//! a newline and falls back to bytes for unknown text) and the control ids named in the metadata.

use candle_core::quantized::gguf_file::Value;

/// llama.cpp's token types.
const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const BYTE: i32 = 6;

pub const PAD: u32 = 0;
pub const EOS: u32 = 1;
pub const BOS: u32 = 2;
pub const UNK: u32 = 3;
const START_OF_TURN: usize = 105;
const END_OF_TURN: usize = 106;

/// The smallest vocabulary that holds the control and byte tokens.
pub const MIN_SIZE: usize = END_OF_TURN + 1 + 256;

/// Piece `i` of the ordinary tokens: a word-initial (`▁…`) or inner piece spelled in base 26,
/// distinct for every `i`.
fn piece(i: usize) -> String {
    let mut s = String::from(if i.is_multiple_of(2) { "▁" } else { "" });
    let mut n = i / 2;
    loop {
        s.push((b'a' + (n % 26) as u8) as char);
        n /= 26;
        if n == 0 {
            break s;
        }
        n -= 1;
    }
}

/// `tokenizer.ggml.*` metadata for a vocabulary of `size` tokens (at least [`MIN_SIZE`]).
pub fn metadata(size: usize) -> Vec<(String, Value)> {
    let mut tokens = Vec::with_capacity(size);
    let mut scores = Vec::with_capacity(size);
    let mut types = Vec::with_capacity(size);
    for id in 0..size {
        let (text, score, kind) = match id {
            0 => ("<pad>".to_string(), 0.0, CONTROL),
            1 => ("<eos>".to_string(), 0.0, CONTROL),
            2 => ("<bos>".to_string(), 0.0, CONTROL),
            3 => ("<unk>".to_string(), 0.0, UNKNOWN),
            4 => ("<mask>".to_string(), 0.0, CONTROL),
            START_OF_TURN => ("<start_of_turn>".to_string(), 0.0, CONTROL),
            END_OF_TURN => ("<end_of_turn>".to_string(), 0.0, CONTROL),
            5..START_OF_TURN => (format!("<unused{}>", id - 5), 0.0, CONTROL),
            _ if id < MIN_SIZE => (format!("<0x{:02X}>", id - END_OF_TURN - 1), 0.0, BYTE),
            _ => (piece(id - MIN_SIZE), -((id - MIN_SIZE) as f32), NORMAL),
        };
        tokens.push(Value::String(text));
        scores.push(Value::F32(score));
        types.push(Value::I32(kind));
    }
    let s = |k: &str, v: Value| (format!("tokenizer.ggml.{k}"), v);
    vec![
        s("model", Value::String("llama".into())),
        s("pre", Value::String("default".into())),
        s("tokens", Value::Array(tokens)),
        s("scores", Value::Array(scores)),
        s("token_type", Value::Array(types)),
        s("bos_token_id", Value::U32(BOS)),
        s("eos_token_id", Value::U32(EOS)),
        s("unknown_token_id", Value::U32(UNK)),
        s("padding_token_id", Value::U32(PAD)),
        s("add_bos_token", Value::Bool(true)),
        s("add_eos_token", Value::Bool(false)),
        s("add_space_prefix", Value::Bool(false)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_distinct_with_gemmas_control_ids_and_every_byte() {
        let md = metadata(MIN_SIZE + 2000);
        let get = |k: &str| &md.iter().find(|(n, _)| n.ends_with(k)).expect(k).1;
        let tokens: Vec<&String> = get(".tokens")
            .to_vec()
            .unwrap()
            .iter()
            .map(|v| v.to_string().unwrap())
            .collect();
        let distinct: std::collections::HashSet<_> = tokens.iter().collect();
        assert_eq!(distinct.len(), tokens.len(), "duplicate token texts");
        assert_eq!(tokens[105], "<start_of_turn>");
        assert_eq!(tokens[106], "<end_of_turn>");
        assert_eq!(tokens[UNK as usize], "<unk>");
        for b in 0..=255u8 {
            assert!(distinct.contains(&&format!("<0x{b:02X}>")), "byte {b}");
        }
        let types = get(".token_type").to_vec().unwrap();
        assert_eq!(types[107].to_i32().unwrap(), BYTE);
        assert_eq!(types[MIN_SIZE].to_i32().unwrap(), NORMAL);
        assert_eq!(tokens[MIN_SIZE], "▁a");
        assert_eq!(get(".scores").to_vec().unwrap().len(), tokens.len());
    }
}
