//! Arbitrary bytes as a checkpoint's `manifest.json` and as the header of one of its `.npy`
//! files (which a tampered or corrupt checkpoint directory controls), read as
//! `Server.restore` reads them.
//!
//! Never a panic and never an access out of bounds (AddressSanitizer), and:
//! - a manifest that parses writes JSON that parses to the same manifest;
//! - every file a parsed manifest's data needs is listed with a checksum, under a plain name;
//! - an `.npy` header that parses has its data inside the file.
//!
//! The seeds (fuzz/corpus/checkpoint_manifest/) are the manifests of the committed checkpoint
//! fixtures (every kind and format version) and a few `.npy` files.
#![no_main]

use echo::checkpoint::manifest::{is_plain_name, Manifest};
use echo::checkpoint::npy::NpyHeader;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(manifest) = Manifest::parse(data) {
        let again = Manifest::parse(&manifest.to_json()).expect("a written manifest parses");
        assert_eq!(again, manifest, "writing and reading a manifest keeps it");
        for name in manifest.data_files() {
            assert!(manifest.files.contains_key(name), "{name} is needed but not listed");
            assert!(is_plain_name(name), "{name} is not a plain name");
        }
    }
    if let Ok(header) = NpyHeader::parse(data) {
        assert!(header.data_offset <= data.len(), "the data starts inside the file");
    }
});
