//! The ingress's counters: what connections and drainers count as they go
//! ([`IngressStats`]), the events transports report ([`TransportEvent`]), and the snapshot
//! read from them ([`IngressSnapshot`]).

use crossbeam_utils::CachePadded;

use super::Ingress;
use crate::metrics::Counter;

/// Counters shared by connections and drainers.
#[derive(Debug, Default)]
pub struct IngressStats {
    pub(super) active_connections: CachePadded<Counter>,
    pub(super) push_blocked: CachePadded<Counter>,
    /// Nanoseconds transport tasks spent in those waits.
    pub(super) push_blocked_ns: Counter,
    /// Connections a transport refused (every slot taken by a working connection).
    pub(super) refused: Counter,
    /// Idle connections a transport closed to admit new ones.
    pub(super) evicted: Counter,
    /// Samples that reached the ingress and are not yet in the backend: +1 on every push, -n
    /// as a drainer's insert puts them in (or drops them); for shared-memory connections the
    /// change of each one's `segment_depth`.
    pub(super) pending: CachePadded<Counter>,
    /// The sum of every connection's `segment_depth` (shared-memory samples committed and not
    /// yet in the backend), kept beside them so that a snapshot walks the connections only
    /// while some shared-memory connection has samples waiting (for `queue_depth_max`).
    pub(super) segment_queued: CachePadded<Counter>,
    /// Samples a transport wrote straight into the backend (`Connection::try_insert_in_place`).
    pub(super) in_place: Counter,
    /// [`TransportEvent`] counts, in the order of [`IngressSnapshot`]'s fields.
    v1: Counter,
    v2: Counter,
    pub(super) resumed: Counter,
    pub(super) deduplicated: Counter,
    pub(super) refused_protocol: Counter,
    pub(super) refused_auth: Counter,
    pub(super) refused_layout: Counter,
    pub(super) shm: Counter,
    pub(super) shm_fallback: Counter,
    /// Samples that arrived in compressed frames, and the bytes of those frames' bodies.
    pub(super) compressed: Counter,
    pub(super) compressed_bytes: Counter,
    /// Samples a connection's task inserted into the backend itself (shared memory,
    /// [`Connection::direct`](super::Connection::direct)), not through a drainer; part of
    /// `samples_inserted_total`.
    pub(super) direct_inserted: Counter,
}

/// A snapshot of the ingress counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IngressSnapshot {
    /// Connections whose socket is open.
    pub active_connections: u64,
    /// Samples waiting in all queues, as of each drainer's last round; a shared-memory
    /// connection's segment is its queue (as of its task's last look).
    pub queue_depth_sum: u64,
    /// Samples waiting in the fullest queue (or shared-memory segment), as above.
    pub queue_depth_max: u64,
    /// Times a transport task waited for a free buffer or queue slot.
    pub push_blocked_count: u64,
    /// Nanoseconds transport tasks spent in those waits, summed over connections.
    pub push_blocked_ns_total: u64,
    /// Samples the drainers moved into the backend, and those a transport inserted itself
    /// (shared-memory connections copy straight from their ring into the backend).
    pub samples_inserted_total: u64,
    /// Bytes of sample buffers the connections hold now (at most `max_buffered_bytes`).
    pub buffered_bytes: u64,
    /// Connections refused because every slot was taken by a working connection.
    pub connections_refused_total: u64,
    /// Idle connections closed to admit new ones.
    pub connections_evicted_total: u64,
    /// Samples that reached the ingress and are not yet in the backend: acknowledged TCP
    /// samples (queued, or in a drainer's round), and samples committed to a shared-memory
    /// segment and not yet copied in (not acknowledged yet: a shared-memory worker's
    /// acknowledgement is the copy).
    pub samples_pending: u64,
    /// Of `samples_inserted_total`, those a transport read from its socket straight into the
    /// ring (large samples already complete in the kernel's buffer), skipping one copy.
    pub samples_received_in_place_total: u64,
    /// Connections that spoke wire protocol v1.
    pub v1_connections_total: u64,
    /// Connections that spoke wire protocol v2.
    pub v2_connections_total: u64,
    /// v2 connections that resumed a session (a client reconnecting).
    pub sessions_resumed_total: u64,
    /// Samples a resuming client did not resend because they were already queued.
    pub samples_deduplicated_total: u64,
    /// Handshakes refused as malformed or unsupported (a v1 client at a server with a token).
    pub handshakes_refused_protocol_total: u64,
    /// Handshakes refused for a missing or wrong token.
    pub handshakes_refused_auth_total: u64,
    /// Handshakes refused because the client's samples have another layout.
    pub handshakes_refused_layout_total: u64,
    /// v2 connections whose samples came through same-host shared memory.
    pub shm_connections_total: u64,
    /// v2 connections that wanted shared memory and sent over TCP instead (another host,
    /// turned off on the server, or the attach failed).
    pub shm_fallbacks_total: u64,
    /// Samples that arrived compressed (wire v2 compressed frames).
    pub samples_received_compressed_total: u64,
    /// Bytes those samples took on the wire (their frames' bodies): against their raw size,
    /// the wire's compression ratio.
    pub compressed_bytes_received_total: u64,
}

/// What a transport reports about its connections, for the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportEvent {
    /// A connection negotiated wire protocol v1.
    V1,
    /// A connection negotiated wire protocol v2.
    V2,
    /// A v2 connection resumed a session, skipping this many already queued samples.
    Resumed {
        /// Samples the client had sent before that were already queued.
        deduplicated: u64,
    },
    /// A handshake was refused as malformed or unsupported.
    RefusedProtocol,
    /// A handshake was refused for a missing or wrong token.
    RefusedAuth,
    /// A handshake was refused for another layout.
    RefusedLayout,
    /// A v2 connection attached a shared-memory channel.
    Shm,
    /// A v2 connection wanted shared memory and uses TCP instead.
    ShmFallback,
}

impl Ingress {
    /// A transport refused a connection (counted for the statistics).
    pub fn note_refused(&self) {
        self.stats.refused.add(1);
    }

    /// A transport closed an idle connection to admit a new one (counted).
    pub fn note_evicted(&self) {
        self.stats.evicted.add(1);
    }

    /// Counts a transport's event for the statistics.
    pub fn note(&self, event: TransportEvent) {
        let stats = &self.stats;
        match event {
            TransportEvent::V1 => stats.v1.add(1),
            TransportEvent::V2 => stats.v2.add(1),
            TransportEvent::Resumed { deduplicated } => {
                stats.resumed.add(1);
                stats.deduplicated.add(deduplicated);
            }
            TransportEvent::RefusedProtocol => stats.refused_protocol.add(1),
            TransportEvent::RefusedAuth => stats.refused_auth.add(1),
            TransportEvent::RefusedLayout => stats.refused_layout.add(1),
            TransportEvent::Shm => stats.shm.add(1),
            TransportEvent::ShmFallback => stats.shm_fallback.add(1),
        }
    }

    /// Counts a sample that arrived compressed, in a frame body of `bytes`.
    pub fn note_compressed(&self, bytes: usize) {
        self.stats.compressed.add(1);
        self.stats.compressed_bytes.add(bytes as u64);
    }

    /// A snapshot of the counters.
    pub fn snapshot(&self) -> IngressSnapshot {
        let mut snap = IngressSnapshot {
            active_connections: self.stats.active_connections.get(),
            push_blocked_count: self.stats.push_blocked.get(),
            push_blocked_ns_total: self.stats.push_blocked_ns.get(),
            buffered_bytes: self.budget.allocated() as u64,
            connections_refused_total: self.stats.refused.get(),
            connections_evicted_total: self.stats.evicted.get(),
            samples_pending: self.stats.pending.get(),
            samples_received_in_place_total: self.stats.in_place.get(),
            v1_connections_total: self.stats.v1.get(),
            v2_connections_total: self.stats.v2.get(),
            sessions_resumed_total: self.stats.resumed.get(),
            samples_deduplicated_total: self.stats.deduplicated.get(),
            handshakes_refused_protocol_total: self.stats.refused_protocol.get(),
            handshakes_refused_auth_total: self.stats.refused_auth.get(),
            handshakes_refused_layout_total: self.stats.refused_layout.get(),
            shm_connections_total: self.stats.shm.get(),
            shm_fallbacks_total: self.stats.shm_fallback.get(),
            samples_received_compressed_total: self.stats.compressed.get(),
            compressed_bytes_received_total: self.stats.compressed_bytes.get(),
            ..IngressSnapshot::default()
        };
        snap.samples_inserted_total = self.stats.direct_inserted.get();
        // Shared-memory connections: their segment is their queue, and no drainer pops it.
        let segment_queued = self.stats.segment_queued.get();
        snap.queue_depth_sum += segment_queued;
        for d in &self.drainers {
            snap.queue_depth_sum += d.depth_sum.get();
            snap.queue_depth_max = snap.queue_depth_max.max(d.depth_max.get());
            snap.samples_inserted_total += d.inserted.get();
            if segment_queued == 0 {
                // No segment holds a sample (as of each connection task's last look): no
                // connection to walk on every `sample()`, however many there are.
                continue;
            }
            // The deepest segment, as of each connection task's last look.
            // `read_recursive`: never waits behind the drainer asking for the write lock
            // (see `capture`).
            let state = d.state.read_recursive();
            let incoming = d.incoming.lock();
            for conn in state.conns.iter().chain(incoming.iter()) {
                snap.queue_depth_max = snap.queue_depth_max.max(conn.segment_depth.get());
            }
        }
        snap
    }
}
