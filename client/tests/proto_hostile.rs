//! The frame reader and request decoder on hostile bytes (the fuzz target's property, run on
//! random inputs and corruptions of valid frames in every `make test`).

use llms_client::proto::{self, Call, Request};
use proptest::prelude::*;

fn valid_frames() -> Vec<u8> {
    let reqs = [
        Request::Bind { app: "app".into(), version: proto::VERSION },
        Request::NewCtx { system_prompt: Some("be brief".into()) },
        Request::Call(Call {
            ctx: "00112233445566778899aabbccddeeff".into(),
            prompt: "héllo".into(),
            max_tokens: 5,
            temperature: 0.5,
            seed: 7,
            stop: vec!["\n".into()],
            raw: false,
            top_p: None,
        }),
        Request::List {},
        Request::Stats {},
        Request::DelCtx { ctx: "x".into() },
    ];
    let mut out = Vec::new();
    for r in &reqs {
        proto::write_frame(&mut out, &proto::encode(r)).unwrap();
    }
    out
}

fn check(data: &[u8]) {
    let mut r = data;
    while let Ok(body) = proto::read_frame(&mut r) {
        assert!(body.len() <= proto::MAX_FRAME);
        if let Ok(req) = proto::decode_request(&body) {
            assert_eq!(proto::decode_request(&proto::encode(&req)).unwrap(), req);
        }
    }
}

#[test]
fn valid_frames_decode() {
    let data = valid_frames();
    let mut r = &data[..];
    let mut n = 0;
    while let Ok(body) = proto::read_frame(&mut r) {
        proto::decode_request(&body).unwrap();
        n += 1;
    }
    assert_eq!(n, 6);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    #[test]
    fn random_bytes(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        check(&data);
    }

    #[test]
    fn corrupted_frames(flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8), cut in any::<prop::sample::Index>()) {
        let mut data = valid_frames();
        for (i, b) in flips {
            let i = i.index(data.len());
            data[i] ^= b;
        }
        let n = cut.index(data.len() + 1);
        check(&data[..n]);
    }
}
