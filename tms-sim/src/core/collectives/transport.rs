//! How the ranks of a communicator find each other and move bytes: a bootstrap root (started by
//! the process that makes the unique id, as NCCL's is) that every rank reports to, then one TCP
//! connection between every pair of ranks. Ranks may be processes of different simulated nodes
//! (Ray places them so); the connections work the same.
//!
//! Every connection has a reader thread that drains it into a mailbox keyed by (peer, tag), so a
//! send never waits for the receiver to post its receive: a group of sends and receives between
//! two ranks cannot deadlock, whatever order each rank issues them in. A connection that closes
//! (the peer exited or was killed) marks the peer dead and wakes every waiter, which then fails
//! with a remote error instead of waiting forever.

use super::CollError;
use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const ID_MAGIC: &[u8; 8] = b"tmscomm1";
/// Bytes of the id the core needs; front ends pad it to their ABI's size (NCCL 128, HCCL 4108).
pub const ID_BYTES: usize = 32;

/// What a unique id (ncclUniqueId, HcclRootInfo) carries: where the bootstrap root listens and a
/// random run number, so that an id from another run (a root long gone, a port reused by
/// another root) is told apart from the right one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UniqueId {
    pub root: SocketAddrV4,
    pub run: u64,
}

impl UniqueId {
    pub fn encode(&self, out: &mut [u8]) {
        out.fill(0);
        out[..8].copy_from_slice(ID_MAGIC);
        out[8..12].copy_from_slice(&self.root.ip().octets());
        out[12..14].copy_from_slice(&self.root.port().to_le_bytes());
        out[16..24].copy_from_slice(&self.run.to_le_bytes());
    }

    pub fn decode(b: &[u8]) -> Option<UniqueId> {
        if b.len() < ID_BYTES || &b[..8] != ID_MAGIC {
            return None;
        }
        let ip = Ipv4Addr::new(b[8], b[9], b[10], b[11]);
        let port = u16::from_le_bytes([b[12], b[13]]);
        let run = u64::from_le_bytes(b[16..24].try_into().ok()?);
        (port != 0 && run != 0).then_some(UniqueId { root: SocketAddrV4::new(ip, port), run })
    }
}

/// The address the simulator's sockets listen on: loopback unless `TMS_SIM_COMM_ADDR` names
/// another of this host's IPv4 addresses (ranks on other machines).
pub fn listen_ip() -> Ipv4Addr {
    std::env::var("TMS_SIM_COMM_ADDR").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(Ipv4Addr::LOCALHOST)
}

fn random_run() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom into a local buffer of its length.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    let v = u64::from_le_bytes(b);
    if n == 8 && v != 0 { v } else { (crate::core::timing::now_ns() ^ ((std::process::id() as u64) << 32)) | 1 }
}

/// What each rank tells the root, and the root hands everyone back (in rank order).
#[derive(Debug, Clone)]
pub struct RankInfo {
    pub rank: usize,
    pub nranks: usize,
    pub data: SocketAddrV4,
    pub node: String,
    pub pid: u32,
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn get_u64(b: &[u8], at: &mut usize) -> Option<u64> {
    let v = u64::from_le_bytes(b.get(*at..*at + 8)?.try_into().ok()?);
    *at += 8;
    Some(v)
}

impl RankInfo {
    fn encode(&self, out: &mut Vec<u8>) {
        put_u64(out, self.rank as u64);
        put_u64(out, self.nranks as u64);
        put_u64(out, u32::from(*self.data.ip()) as u64);
        put_u64(out, self.data.port() as u64);
        put_u64(out, self.pid as u64);
        put_u64(out, self.node.len() as u64);
        out.extend_from_slice(self.node.as_bytes());
    }

    fn decode(b: &[u8], at: &mut usize) -> Option<RankInfo> {
        let rank = get_u64(b, at)? as usize;
        let nranks = get_u64(b, at)? as usize;
        let ip = Ipv4Addr::from(get_u64(b, at)? as u32);
        let port = get_u64(b, at)? as u16;
        let pid = get_u64(b, at)? as u32;
        let len = get_u64(b, at)? as usize;
        let node = String::from_utf8_lossy(b.get(*at..*at + len)?).into_owned();
        *at += len;
        Some(RankInfo { rank, nranks, data: SocketAddrV4::new(ip, port), node, pid })
    }
}

fn write_frame(s: &mut TcpStream, tag: u64, payload: &[u8]) -> std::io::Result<()> {
    let mut head = [0u8; 16];
    head[..8].copy_from_slice(&tag.to_le_bytes());
    head[8..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    s.write_all(&head)?;
    s.write_all(payload)
}

/// Most bytes one frame may announce: a corrupt or foreign stream must not make us allocate
/// without bound.
const MAX_FRAME: u64 = 1 << 32;

fn read_frame(s: &mut TcpStream) -> std::io::Result<(u64, Vec<u8>)> {
    let mut head = [0u8; 16];
    s.read_exact(&mut head)?;
    let tag = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
    let len = u64::from_le_bytes(head[8..].try_into().expect("8 bytes"));
    if len > MAX_FRAME {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "frame too large"));
    }
    let mut payload = vec![0u8; len as usize];
    s.read_exact(&mut payload)?;
    Ok((tag, payload))
}

const HELLO: u64 = 1;
const TABLE: u64 = 2;
const REFUSED: u64 = 3;
const TIMED_OUT: u64 = 4;

/// Starts a bootstrap root in this process and returns its id. The root waits up to `timeout`
/// for every rank of the communicator that uses the id, then answers them all (or, if some never
/// came, tells those that did which ranks are missing) and ends.
pub fn create_root(timeout: Duration) -> Result<UniqueId, CollError> {
    create_root_at(SocketAddrV4::new(listen_ip(), 0), random_run(), timeout)
}

/// A root at a known address and run number (a rank table names no root: its ranks derive both
/// from the table). Port 0 picks a free one.
pub fn create_root_at(at: SocketAddrV4, run: u64, timeout: Duration) -> Result<UniqueId, CollError> {
    let listener =
        TcpListener::bind(at).map_err(|e| CollError::System(format!("bootstrap root: cannot listen on {at}: {e}")))?;
    let root = match listener.local_addr() {
        Ok(SocketAddr::V4(a)) => a,
        _ => return Err(CollError::System("bootstrap root: no IPv4 address".into())),
    };
    let id = UniqueId { root, run };
    std::thread::Builder::new()
        .name("tms-sim-bootstrap".into())
        .spawn(move || run_root(listener, id.run, timeout))
        .map_err(|e| CollError::System(format!("bootstrap root: cannot start its thread: {e}")))?;
    Ok(id)
}

fn run_root(listener: TcpListener, run: u64, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    let _ = listener.set_nonblocking(true);
    let mut joined: Vec<(RankInfo, TcpStream)> = Vec::new();
    let mut expected: Option<usize> = None;
    loop {
        if let Some(n) = expected
            && joined.len() == n
        {
            break;
        }
        if Instant::now() >= deadline {
            let missing: Vec<String> = match expected {
                Some(n) => {
                    (0..n).filter(|r| !joined.iter().any(|(i, _)| i.rank == *r)).map(|r| r.to_string()).collect()
                }
                None => vec!["all".into()],
            };
            let msg = format!(
                "rank(s) {} never joined within {} s (the connect timeout)",
                missing.join(", "),
                timeout.as_secs()
            );
            for (_, mut s) in joined {
                let _ = write_frame(&mut s, TIMED_OUT, msg.as_bytes());
            }
            return;
        }
        match listener.accept() {
            Ok((mut s, _)) => {
                let _ = s.set_nonblocking(false);
                let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
                let Ok((kind, body)) = read_frame(&mut s) else { continue };
                let mut at = 0;
                let their_run = get_u64(&body, &mut at);
                let info = RankInfo::decode(&body, &mut at);
                let refuse = |s: &mut TcpStream, why: String| {
                    let _ = write_frame(s, REFUSED, why.as_bytes());
                };
                match (kind, their_run, info) {
                    (HELLO, Some(r), Some(info)) if r == run => {
                        let n = *expected.get_or_insert(info.nranks);
                        if info.nranks != n {
                            refuse(
                                &mut s,
                                format!("rank {} says nranks {}, rank(s) before it said {n}", info.rank, info.nranks),
                            );
                        } else if info.rank >= n {
                            refuse(&mut s, format!("rank {} is out of range for {n} ranks", info.rank));
                        } else if joined.iter().any(|(i, _)| i.rank == info.rank) {
                            refuse(&mut s, format!("rank {} joined twice", info.rank));
                        } else {
                            joined.push((info, s));
                        }
                    }
                    _ => refuse(&mut s, "the unique id belongs to another communicator or run".into()),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(2)),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    joined.sort_by_key(|(i, _)| i.rank);
    let mut table = Vec::new();
    put_u64(&mut table, joined.len() as u64);
    for (i, _) in &joined {
        i.encode(&mut table);
    }
    for (_, mut s) in joined {
        let _ = write_frame(&mut s, TABLE, &table);
    }
}

/// Reports to the root and returns every rank's information (in rank order), or the reason the
/// communicator could not be formed. Retries a root that does not answer yet (it may not have
/// started) until `deadline`.
fn rendezvous(id: UniqueId, me: &RankInfo, deadline: Instant) -> Result<Vec<RankInfo>, CollError> {
    let mut stream = loop {
        match TcpStream::connect_timeout(&SocketAddr::V4(id.root), Duration::from_secs(1)) {
            Ok(s) => break s,
            Err(e) => {
                if Instant::now() >= deadline {
                    return Err(CollError::System(format!(
                        "cannot reach the bootstrap root at {} ({e}): the process that made the unique id is gone or the id is from another run",
                        id.root
                    )));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    let mut hello = Vec::new();
    put_u64(&mut hello, id.run);
    me.encode(&mut hello);
    write_frame(&mut stream, HELLO, &hello).map_err(|e| CollError::System(format!("bootstrap: {e}")))?;
    // The root answers once everyone has come, or refuses when its own timeout passes; a margin
    // over ours covers a root that started later.
    let wait = deadline.saturating_duration_since(Instant::now()) + Duration::from_secs(5);
    let _ = stream.set_read_timeout(Some(wait));
    let (kind, body) = read_frame(&mut stream).map_err(|e| {
        CollError::Timeout(format!("no answer from the bootstrap root at {} ({e}): some rank never joined", id.root))
    })?;
    match kind {
        TABLE => {
            let mut at = 0;
            let n = get_u64(&body, &mut at).unwrap_or(0) as usize;
            let infos: Option<Vec<RankInfo>> = (0..n).map(|_| RankInfo::decode(&body, &mut at)).collect();
            infos
                .filter(|v| v.len() == me.nranks)
                .ok_or_else(|| CollError::System("bootstrap: malformed rank table".into()))
        }
        TIMED_OUT => Err(CollError::Timeout(String::from_utf8_lossy(&body).into_owned())),
        _ => Err(CollError::InvalidUsage(String::from_utf8_lossy(&body).into_owned())),
    }
}

#[derive(Default)]
struct Boxes {
    queues: HashMap<(usize, u64), VecDeque<Vec<u8>>>,
    dead: Vec<Option<String>>,
    aborted: bool,
}

/// A rank's connections to every other rank, and what arrived on them.
pub struct Mesh {
    pub rank: usize,
    pub peers: Vec<RankInfo>,
    writers: Vec<Option<Mutex<TcpStream>>>,
    boxes: Arc<(Mutex<Boxes>, Condvar)>,
}

impl Mesh {
    /// Joins the communicator `id` as `rank` of `nranks`: rendezvous at the root, then a
    /// connection to every other rank (the higher rank dials the lower).
    pub fn join(id: UniqueId, rank: usize, nranks: usize, node: &str, timeout: Duration) -> Result<Mesh, CollError> {
        let deadline = Instant::now() + timeout;
        let listener = TcpListener::bind(SocketAddrV4::new(listen_ip(), 0))
            .map_err(|e| CollError::System(format!("cannot listen for peers: {e}")))?;
        let data = match listener.local_addr() {
            Ok(SocketAddr::V4(a)) => a,
            _ => return Err(CollError::System("no IPv4 address to listen on".into())),
        };
        let me = RankInfo { rank, nranks, data, node: node.to_string(), pid: std::process::id() };
        let peers = rendezvous(id, &me, deadline)?;
        let mut streams: Vec<Option<TcpStream>> = (0..nranks).map(|_| None).collect();
        for (r, p) in peers.iter().enumerate().take(rank) {
            let mut s = connect_until(p.data, deadline)
                .map_err(|e| CollError::Timeout(format!("cannot connect to rank {r} at {}: {e}", p.data)))?;
            let mut hello = Vec::new();
            put_u64(&mut hello, id.run);
            put_u64(&mut hello, rank as u64);
            write_frame(&mut s, HELLO, &hello).map_err(|e| CollError::System(format!("rank {r}: {e}")))?;
            streams[r] = Some(s);
        }
        let _ = listener.set_nonblocking(true);
        let mut missing = nranks - 1 - rank;
        while missing > 0 {
            match listener.accept() {
                Ok((mut s, _)) => {
                    let _ = s.set_nonblocking(false);
                    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
                    let Ok((HELLO, body)) = read_frame(&mut s) else { continue };
                    let mut at = 0;
                    let (Some(run), Some(r)) = (get_u64(&body, &mut at), get_u64(&body, &mut at)) else { continue };
                    let r = r as usize;
                    if run == id.run && r > rank && r < nranks && streams[r].is_none() {
                        let _ = s.set_read_timeout(None);
                        streams[r] = Some(s);
                        missing -= 1;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(CollError::Timeout(format!(
                            "{missing} higher rank(s) never connected within the connect timeout"
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(CollError::System(format!("accepting peers: {e}"))),
            }
        }
        Ok(Mesh::start(rank, peers, streams))
    }

    fn start(rank: usize, peers: Vec<RankInfo>, streams: Vec<Option<TcpStream>>) -> Mesh {
        let n = peers.len();
        let boxes = Arc::new((Mutex::new(Boxes { dead: vec![None; n], ..Boxes::default() }), Condvar::new()));
        let mut writers = Vec::with_capacity(n);
        for (peer, s) in streams.into_iter().enumerate() {
            let Some(s) = s else {
                writers.push(None);
                continue;
            };
            let _ = s.set_nodelay(true);
            let reader = s.try_clone();
            writers.push(Some(Mutex::new(s)));
            let boxes = boxes.clone();
            let spawned = reader.map_err(|e| e.to_string()).and_then(|mut r| {
                let b = boxes.clone();
                std::thread::Builder::new()
                    .name("tms-sim-comm".into())
                    .spawn(move || drain(&mut r, peer, &b))
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            });
            if let Err(e) = spawned {
                mark_dead(&boxes, peer, format!("cannot read from rank {peer}: {e}"));
            }
        }
        Mesh { rank, peers, writers, boxes }
    }

    pub fn nranks(&self) -> usize {
        self.peers.len()
    }

    /// Sends `payload` to `peer` under `tag`. Returns at once when the bytes are handed to the
    /// connection; the peer's reader takes them whether or not it has posted the receive.
    pub fn send(&self, peer: usize, tag: u64, payload: &[u8]) -> Result<(), CollError> {
        self.check(peer)?;
        if peer == self.rank {
            // A rank's messages to itself (a send to its own rank) go straight to its mailbox.
            let (lock, cv) = &*self.boxes;
            lock.lock()
                .unwrap_or_else(|e| e.into_inner())
                .queues
                .entry((peer, tag))
                .or_default()
                .push_back(payload.to_vec());
            cv.notify_all();
            return Ok(());
        }
        let Some(Some(w)) = self.writers.get(peer) else {
            return Err(CollError::Internal(format!("no connection to rank {peer}")));
        };
        let mut s = w.lock().unwrap_or_else(|e| e.into_inner());
        write_frame(&mut s, tag, payload).map_err(|e| {
            let why = format!("rank {peer} is gone (sending: {e})");
            mark_dead(&self.boxes, peer, why.clone());
            CollError::Remote(why)
        })
    }

    /// Waits for the next message from `peer` under `tag`.
    pub fn recv(&self, peer: usize, tag: u64) -> Result<Vec<u8>, CollError> {
        let (lock, cv) = &*self.boxes;
        let mut b = lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(m) = b.queues.get_mut(&(peer, tag)).and_then(|q| q.pop_front()) {
                return Ok(m);
            }
            if b.aborted {
                return Err(CollError::Aborted);
            }
            if let Some(why) = b.dead.get(peer).cloned().flatten() {
                return Err(CollError::Remote(why));
            }
            b = cv.wait(b).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn check(&self, peer: usize) -> Result<(), CollError> {
        let b = self.boxes.0.lock().unwrap_or_else(|e| e.into_inner());
        if b.aborted {
            return Err(CollError::Aborted);
        }
        match b.dead.get(peer) {
            Some(Some(why)) => Err(CollError::Remote(why.clone())),
            Some(None) => Ok(()),
            None => Err(CollError::Internal(format!("rank {peer} does not exist"))),
        }
    }

    /// Fails every waiting and later operation and closes the connections (ncclCommAbort).
    pub fn abort(&self) {
        {
            let (lock, cv) = &*self.boxes;
            lock.lock().unwrap_or_else(|e| e.into_inner()).aborted = true;
            cv.notify_all();
        }
        self.close();
    }

    pub fn close(&self) {
        for s in self.writers.iter().flatten() {
            let _ = s.lock().unwrap_or_else(|e| e.into_inner()).shutdown(Shutdown::Both);
        }
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        self.close();
    }
}

fn connect_until(to: SocketAddrV4, deadline: Instant) -> std::io::Result<TcpStream> {
    loop {
        match TcpStream::connect_timeout(&SocketAddr::V4(to), Duration::from_secs(1)) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn mark_dead(boxes: &(Mutex<Boxes>, Condvar), peer: usize, why: String) {
    let (lock, cv) = boxes;
    let mut b = lock.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(slot) = b.dead.get_mut(peer)
        && slot.is_none()
    {
        *slot = Some(why);
    }
    cv.notify_all();
}

fn drain(r: &mut TcpStream, peer: usize, boxes: &(Mutex<Boxes>, Condvar)) {
    loop {
        match read_frame(r) {
            Ok((tag, payload)) => {
                let (lock, cv) = boxes;
                lock.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .queues
                    .entry((peer, tag))
                    .or_default()
                    .push_back(payload);
                cv.notify_all();
            }
            Err(e) => {
                mark_dead(
                    boxes,
                    peer,
                    format!("rank {peer} closed its connection ({e}): it exited, was killed or aborted"),
                );
                return;
            }
        }
    }
}
