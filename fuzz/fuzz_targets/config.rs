//! llmsd's configuration file (TOML, hand-edited): parsed and validated, or refused with an
//! error; never a panic, whatever the values.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(c) = toml::from_str::<llmsd::config::Config>(text) {
        if c.validate().is_ok() {
            // Everything the service derives from valid settings is derivable.
            let _ = (c.budget_bytes(), c.level_formats(), c.ablations(), c.policy(), c.durability(), c.weights_budget());
            let _ = c.mm_config(64);
        }
    }
});
