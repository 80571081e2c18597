//! A weight image's trailer (a file next to the model, maybe truncated or edited): read and
//! checked, or refused; what is accepted describes groups and slots inside the data.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use mm::weights::ImageInfo;

fuzz_target!(|data: &[u8]| {
    static DIR: OnceLock<std::path::PathBuf> = OnceLock::new();
    let p = DIR.get_or_init(|| llms_fuzz::work_dir("image")).join("model.img");
    std::fs::write(&p, data).unwrap();
    if let Ok(info) = ImageInfo::read(&p) {
        assert_eq!(info.data_len, info.n_slots() * info.slot_size);
        for g in &info.groups {
            assert!(g.offset + g.len <= info.data_len as u64);
        }
    }
});
