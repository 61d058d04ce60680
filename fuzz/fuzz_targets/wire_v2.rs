//! Arbitrary bytes into every wire v2 parser: what a hostile client sends the server (the
//! first bytes after the greeting: v1 data or a hello) and what a hostile server sends a
//! client (an offer, a reply, an error frame).
//!
//! Never a panic, and:
//! - `parse_opening` never reads past a hello it returns, tells v1 data from a hello at the
//!   first byte that differs from the nonce, and is monotone: fed a growing prefix (as the
//!   server is), it says "need more" until the first deciding byte and then the same answer;
//! - a hello it returns re-encodes (unsigned) to a hello that parses to the same fields;
//! - a reply or an offer that parses re-encodes to bytes that parse to the same value, and
//!   `Reply::parse` reports the length it consumed; a closing notice's reason byte decodes to
//!   the reason it encodes, and a persisted notice to the number that encodes to its bytes;
//! - a sample frame (`FrameMeta::split`: kind, header, payload; what a client sends after the
//!   handshake) that parses re-encodes to the same header, and one that does not parse is
//!   an error, not a panic (an unknown kind, a short header, an episode flag above 2).
//!
//! Byte 0 of the input picks the mode: odd inputs get the offer's nonce and the v2 magic put
//! in front, so the fuzzer reaches the hello's body instead of stopping at the nonce.
#![no_main]

use echo::transport::wire::v2::{self, FrameMeta, Hello, Mode, Offer, Opening, Reply};
use echo::EchoError;
use libfuzzer_sys::fuzz_target;

const MAX_BODY: usize = 1 << 16;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let offer = Offer { mode: Mode::Open, nonce: *b"0123456789abcdef0123456789abcdef" };
    let mut input = Vec::new();
    if mode & 1 == 1 {
        input.extend_from_slice(&offer.nonce);
        input.extend_from_slice(b"ECHO\x02");
    }
    input.extend_from_slice(rest);
    check_opening(&input, &offer);
    check_client_side(rest);
    check_frame(rest);
});

fn check_frame(bytes: &[u8]) {
    let Ok((meta, payload)) = FrameMeta::split(bytes) else { return };
    let header_len = bytes.len() - payload.len();
    let step = matches!(bytes[0], v2::STEP | v2::STEP_PRIORITY);
    let (again, n) = meta.encode_as(step);
    assert_eq!(&again[..n], &bytes[..header_len], "a parsed frame header re-encodes");
    assert_eq!(FrameMeta::rest_len(bytes[0]), Some(header_len - 1));
}

fn check_opening(input: &[u8], offer: &Offer) {
    let whole = v2::parse_opening(input, offer, MAX_BODY);
    if let Ok(Opening::Hello(hello, body, len)) = &whole {
        assert!(*len <= input.len());
        assert_eq!(&input[*len - body.len()..*len], &body[..]);
        let plain = Hello { mac: None, ..(**hello).clone() };
        let bytes = plain.encode(offer, None).expect("a parsed hello re-encodes");
        match v2::parse_opening(&bytes, offer, usize::MAX) {
            Ok(Opening::Hello(again, _, n)) => {
                assert_eq!((*again, n), (plain, bytes.len()), "re-encoded hello differs");
            }
            other => panic!("a re-encoded hello does not parse: {other:?}"),
        }
    }
    // Monotone in the prefix: "need more" before the deciding length, then the same answer.
    let decided = |r: &Result<Opening, EchoError>| !matches!(r, Ok(Opening::NeedMore));
    let mut seen_decision = false;
    for cut in (0..=input.len()).step_by(7).chain([input.len()]) {
        let got = v2::parse_opening(&input[..cut], offer, MAX_BODY);
        if seen_decision {
            assert!(decided(&got), "undecided again at {cut}: {got:?}");
            assert_eq!(kind(&got), kind(&whole), "a longer prefix changed the answer at {cut}");
        }
        seen_decision |= decided(&got);
    }
}

fn kind(r: &Result<Opening, EchoError>) -> &'static str {
    match r {
        Ok(Opening::V1) => "v1",
        Ok(Opening::NeedMore) => "need more",
        Ok(Opening::Hello(..)) => "hello",
        Err(_) => "error",
    }
}

fn check_client_side(bytes: &[u8]) {
    if let Ok(Some(offer)) = Offer::parse(bytes) {
        assert_eq!(Offer::parse(&offer.encode()).unwrap(), Some(offer.clone()));
        assert!(!offer.encode().contains(&v2::ACK), "an offer must hold no ack byte");
    }
    if let Ok(Some((reply, len))) = Reply::parse(bytes) {
        assert!(len <= bytes.len());
        let again = Reply::parse(&reply.encode()).expect("re-encoded reply").expect("complete");
        assert_eq!(again.0, reply);
    }
    if let Ok(Some((message, len))) = v2::parse_error(bytes) {
        assert!(len <= bytes.len() && message.len() <= v2::MAX_MESSAGE as usize * 3);
    }
    // A persisted notice: complete, it is the bytes its number encodes to.
    if let Some(seq) = v2::parse_persisted(bytes) {
        assert_eq!(&v2::encode_persisted(seq)[..], &bytes[..v2::PERSISTED_LEN]);
    }
    // A closing notice's reason byte: a known reason is the byte it came from.
    if let Some(&byte) = bytes.first() {
        if let Some(why) = v2::Closing::from_byte(byte) {
            assert_eq!(why as u8, byte);
        }
    }
}
