//! The published parameters' shared-memory region (`src/transport/shm/params.rs`), stressed:
//! a learner publishes versions of 1 MiB (every byte of version `v` is `v as u8`, and the
//! first 8 hold `v`) as fast as it can while two readers, each with its own read-only mapping
//! of the region (as a worker process has), copy the newest version in a loop. Every copy
//! they keep is one version whole, and no reader's versions go back.
#![cfg(all(target_os = "linux", not(loom)))]

use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use echo::params::Params;
use echo::spec::{ArraySpec, DataSpec};
use echo::transport::shm::params::{ParamView, ViewRead};

const SIZE: usize = 1 << 20;

fn version_bytes(version: u64) -> Vec<u8> {
    let mut bytes = vec![version as u8; SIZE];
    bytes[..8].copy_from_slice(&version.to_le_bytes());
    bytes
}

#[test]
fn readers_of_the_region_never_keep_a_torn_or_older_version() {
    let params = Arc::new(Params::default());
    let spec = DataSpec::new(vec![ArraySpec::new(vec![SIZE], 1).unwrap()]).unwrap();
    params.publish(&spec, &[&version_bytes(1)], None, None).unwrap();
    let region = params.region().expect("a region on Linux");
    let done = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let fd = region.fd().as_fd().try_clone_to_owned().unwrap();
            let done = Arc::clone(&done);
            std::thread::spawn(move || {
                let mut view = ParamView::new(fd);
                let mut out = vec![0u8; SIZE];
                let (mut last, mut kept, mut busy) = (0u64, 0u64, 0u64);
                while !done.load(Relaxed) {
                    match view.read(&mut out, 16).unwrap() {
                        ViewRead::Copied(version) => {
                            let head = u64::from_le_bytes(out[..8].try_into().unwrap());
                            assert_eq!(head, version, "the copy's first bytes are its version's");
                            assert!(out[8..].iter().all(|&b| b == version as u8), "torn copy");
                            assert!(version >= last, "{version} after {last}");
                            (last, kept) = (version, kept + 1);
                        }
                        ViewRead::Busy => busy += 1,
                        other => panic!("{other:?}"),
                    }
                }
                (kept, busy)
            })
        })
        .collect();
    let until = Instant::now() + Duration::from_secs(2);
    let mut version = 1;
    while Instant::now() < until && version < 3_000 {
        version += 1;
        params.publish(&spec, &[&version_bytes(version)], None, None).unwrap();
    }
    done.store(true, Relaxed);
    for reader in readers {
        let (kept, _busy) = reader.join().unwrap();
        assert!(kept > 10, "a reader kept only {kept} copies");
    }
    let mut view = ParamView::new(region.fd().as_fd().try_clone_to_owned().unwrap());
    let mut out = vec![0u8; SIZE];
    assert_eq!(view.read(&mut out, 16).unwrap(), ViewRead::Copied(version));
    let mut small = vec![0u8; 8];
    assert_eq!(view.read(&mut small, 1).unwrap(), ViewRead::Size(SIZE as u64));
}
