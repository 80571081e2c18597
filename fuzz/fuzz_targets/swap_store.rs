//! The swap store's recovery on an arbitrary context file (records torn, edited, foreign):
//! every chunk it keeps passes its checks and reads back; nothing else is kept.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use mm::store::Store;
use mm::StoreGeometry;

const FP: u64 = 0x11ab_5f00_d5ee_d001;
const CTX: u64 = 1;

fuzz_target!(|data: &[u8]| {
    static DIR: OnceLock<std::path::PathBuf> = OnceLock::new();
    let dir = DIR.get_or_init(|| llms_fuzz::work_dir("store"));
    // One of the two layers kept by a dead chunk: records of one layer, and whole ones whose
    // second layer was given back, are recovered too.
    let geom = StoreGeometry { n_layers: 2, max_layer_bytes: 512, kept_layers: 1 };
    let sub = dir.join(format!("{FP:016x}"));
    std::fs::create_dir_all(&sub).unwrap();
    std::fs::write(sub.join(format!("ctx-{CTX:016x}.kv")), data).unwrap();
    let store = match Store::open(dir, FP, geom, mm::Durability::Off) {
        Ok(s) => s,
        Err(_) => return,
    };
    for chunk in 0..64 {
        if let Some(e) = store.entry(CTX, chunk) {
            let mut out = vec![0u8; 2 * 512];
            store.read(&e.meta, &mut out).expect("a record recovery kept reads back");
        }
    }
});
