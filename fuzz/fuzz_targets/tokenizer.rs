//! The tokenizer on arbitrary text (what an app sends as a prompt): the default model's
//! vocabulary, both special-token modes; whatever encodes decodes to the same bytes.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

fn tokenizer() -> &'static engine::tokenizer::Tokenizer {
    static T: OnceLock<engine::tokenizer::Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let f = engine::gguf::GgufFile::open(&llms_fuzz::model_path()).expect("the default model (make model)");
        engine::tokenizer::Tokenizer::from_gguf(&f).expect("its tokenizer")
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let Ok(text) = std::str::from_utf8(rest) else { return };
    let special = mode & 1 == 1;
    if let Ok(ids) = tokenizer().encode(text, false, special) {
        assert_eq!(tokenizer().decode(&ids, special), text.as_bytes(), "encode/decode round trip (special: {special})");
    }
});
