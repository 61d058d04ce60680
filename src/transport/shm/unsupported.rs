//! Platforms without the shared-memory path (everything but Linux): stand-ins with the
//! interfaces the TCP transport calls, which decline every request, so clients send over TCP.

/// Platforms without the shared-memory path: every request falls back to TCP.
pub(crate) mod server {
    use std::io;
    use std::net::SocketAddr;

    use crate::transport::shm::{ShmEnd as End, SHM_OFF};
    use crate::transport::tcp::link::Link;
    use crate::transport::tcp::session::{Session, Shared};
    use crate::transport::wire::v2::ShmOffer;

    pub(crate) struct Prepared {
        pub(crate) offer: ShmOffer,
    }

    pub(crate) fn prepare(
        shared: &Shared,
        _: SocketAddr,
        _: &Link<'_>,
    ) -> Result<Prepared, String> {
        Err(if shared.shared_memory {
            "the server's platform has no shared-memory path (Linux only)"
        } else {
            SHM_OFF
        }
        .into())
    }

    pub(crate) async fn serve(
        _: &mut Link<'_>,
        _: &Shared,
        _: &Session,
        _: Prepared,
        _: Option<&crate::params::Params>,
    ) -> io::Result<End> {
        Ok(End::Declined)
    }
}

/// Stand-ins where there is no shared-memory path: never constructed.
pub(crate) mod worker {
    use std::io;
    use std::time::{Duration, Instant};

    use crate::transport::wire::v2::{self, FrameMeta};

    pub(crate) enum ShmWriter {}
    pub(crate) enum LossBell {}

    impl ShmWriter {
        pub(crate) fn taken(&self) -> u64 {
            match *self {}
        }
        pub(crate) fn committed(&self) -> u64 {
            match *self {}
        }
        pub(crate) fn slots(&self) -> usize {
            match *self {}
        }
        pub(crate) fn try_send(&mut self, _: &[&[u8]], _: &FrameMeta) -> bool {
            match *self {}
        }
        pub(crate) fn wait_taken(&self, _: u64, _: Instant) -> bool {
            match *self {}
        }
    }

    impl crate::transport::shm::ring::Bell for LossBell {
        fn ring(&self) {
            match *self {}
        }
    }

    pub(crate) fn attach(_: &v2::ShmOffer, _: usize, _: Duration) -> Result<ShmWriter, String> {
        Err("the shared-memory path is Linux-only".into())
    }

    pub(crate) fn loss_bell(writer: &ShmWriter) -> io::Result<LossBell> {
        match *writer {}
    }
}
