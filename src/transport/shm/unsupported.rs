//! Platforms without the shared-memory path (everything but Linux): stand-ins with the
//! interfaces the TCP transport calls, which decline every request, so clients send over TCP.

/// Platforms without the shared-memory path: every request falls back to TCP.
pub(crate) mod server {
    use std::io;
    use std::net::SocketAddr;

    use crate::transport::shm::{ShmEnd as End, SHM_OFF};
    use crate::transport::tcp::{Link, Session, Shared};
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
    ) -> io::Result<End> {
        Ok(End::Declined)
    }
}
