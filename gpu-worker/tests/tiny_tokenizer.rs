//! The tiny tokenizer fixture fits the tiny models: Gemma's special ids, every id decodable, text
//! round trips, and the chat template renders inside the vocabulary.

mod common;

use hearth_shared::chat::{render, Detokenizer, Message, Role};
use hearth_shared::tokenizer::Tokenizer;
use hearth_worker::fixtures::{write_tiny_tokenizer, BOS, END_OF_TURN, EOS, START_OF_TURN};

#[test]
fn the_tiny_tokenizer_matches_the_tiny_models() {
    let path = common::temp_dir("tok").join("tokenizer.json");
    write_tiny_tokenizer(&path, 512).expect("write");
    let tok = Tokenizer::from_file(&path).expect("load");
    assert_eq!(
        (
            tok.bos_id,
            tok.eos_id,
            tok.start_of_turn_id,
            tok.end_of_turn_id
        ),
        (BOS, EOS, START_OF_TURN, END_OF_TURN)
    );
    assert_eq!(tok.vocab_size(), 512);
    for text in ["Hello, world!", "héllo 🙂 ünïcode", "  spaced  out  "] {
        let ids = tok.encode(text).expect("encode");
        assert!(ids.iter().all(|&i| i < 512), "{ids:?}");
        assert_eq!(tok.decode(&ids).expect("decode"), text);
        let mut d = Detokenizer::new();
        let mut out = String::new();
        for &id in &ids {
            out += &d.push(&tok, id).expect("push");
        }
        out += &d.finish(&tok).expect("finish");
        assert_eq!(out, text);
    }
    // Whatever a random model generates can be decoded.
    let all: Vec<u32> = (0..512).collect();
    tok.decode(&all).expect("every id decodes");
    let p = render(
        &tok,
        &[
            Message::new(Role::System, "sys"),
            Message::new(Role::User, "hi"),
        ],
        1000,
    )
    .expect("render");
    assert!(p.tokens.iter().all(|&i| i < 512));
    assert_eq!(p.tokens[0], BOS);
    assert_eq!(
        tok.decode_with_special(&p.tokens).expect("decode"),
        "<bos><start_of_turn>user\nsys\n\nhi<end_of_turn>\n<start_of_turn>model\n"
    );
}
