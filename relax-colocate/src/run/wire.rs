//! The worker protocol's transport (docs/worker-protocol.md): JSON lines over a Unix socket whose
//! path the runner passes in RELAX_WORKER_SOCKET. The worker connects and says hello; the runner
//! sends requests `{"id", "method", "params"}`; the worker answers each with `{"id", "result"}` or
//! `{"id", "error": {"kind", "message"}}`.

use super::protocol::{ErrorBody, Hello, HelloMsg, PROTOCOL, Request, Response, Shutdown};
use super::protocol::{Method, decode};
use serde_json::Value;
use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// One message may carry a whole batch; anything larger is a broken peer.
pub const MAX_LINE: usize = 256 << 20;

pub struct Conn {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    pending: Vec<u8>,
}

/// Why reading a line stopped.
#[derive(Debug)]
pub enum ReadError {
    Closed,
    TimedOut,
    /// The caller's `keep_waiting` said stop (a child exited, Ctrl-C).
    Abandoned(String),
    Io(std::io::Error),
    Malformed(String),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Closed => f.write_str("the connection closed"),
            ReadError::TimedOut => f.write_str("timed out"),
            ReadError::Abandoned(why) => f.write_str(why),
            ReadError::Io(e) => write!(f, "{e}"),
            ReadError::Malformed(m) => write!(f, "malformed message: {m}"),
        }
    }
}

impl Conn {
    pub fn new(stream: UnixStream) -> std::io::Result<Conn> {
        Ok(Conn { writer: stream.try_clone()?, reader: BufReader::new(stream), pending: Vec::new() })
    }

    /// Whether a message may be waiting: bytes buffered here, or the socket readable (or closed)
    /// within `wait`. A true answer is followed by `recv`, which reads the rest of the line.
    pub fn readable(&self, wait: Duration) -> bool {
        if !self.reader.buffer().is_empty() || !self.pending.is_empty() {
            return true;
        }
        let mut fd = libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(self.reader.get_ref()),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd for a socket this connection owns.
        let n = unsafe { libc::poll(&mut fd, 1, wait.as_millis().min(i32::MAX as u128) as i32) };
        n > 0
    }

    pub fn send(&mut self, v: &Value) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(v).expect("JSON values serialize");
        line.push(b'\n');
        self.writer.set_write_timeout(None)?;
        self.writer.write_all(&line)
    }

    /// Writes one message by `deadline`, in short slices so `keep_waiting` can stop the wait (it
    /// returns Err(reason) to abandon). A peer that reads nothing (stopped, or stuck) fills the
    /// socket buffer, and a larger message would otherwise block the writer for good.
    pub fn send_within(
        &mut self,
        v: &Value,
        deadline: Instant,
        mut keep_waiting: impl FnMut() -> Result<(), String>,
    ) -> Result<(), ReadError> {
        let mut line = serde_json::to_vec(v).expect("JSON values serialize");
        line.push(b'\n');
        self.writer.set_write_timeout(Some(Duration::from_millis(50))).map_err(ReadError::Io)?;
        let mut done = 0;
        while done < line.len() {
            match self.writer.write(&line[done..]) {
                Ok(0) => return Err(ReadError::Closed),
                Ok(n) => {
                    done += n;
                    continue;
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {}
                Err(e) => return Err(ReadError::Io(e)),
            }
            if Instant::now() >= deadline {
                return Err(ReadError::TimedOut);
            }
            keep_waiting().map_err(ReadError::Abandoned)?;
        }
        Ok(())
    }

    /// Reads one JSON line. Waits in short slices so `keep_waiting` can stop the wait (it returns
    /// Err(reason) to abandon), up to `deadline`.
    pub fn recv(
        &mut self,
        deadline: Option<Instant>,
        mut keep_waiting: impl FnMut() -> Result<(), String>,
    ) -> Result<Value, ReadError> {
        self.reader.get_ref().set_read_timeout(Some(Duration::from_millis(50))).map_err(ReadError::Io)?;
        loop {
            match self.reader.read_until(b'\n', &mut self.pending) {
                Ok(0) => return Err(ReadError::Closed),
                Ok(_) if self.pending.ends_with(b"\n") => {
                    let line = std::mem::take(&mut self.pending);
                    return serde_json::from_slice(&line).map_err(|e| {
                        ReadError::Malformed(format!(
                            "{e}: {:?}",
                            String::from_utf8_lossy(&line[..line.len().min(200)])
                        ))
                    });
                }
                Ok(_) => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {}
                Err(e) => return Err(ReadError::Io(e)),
            }
            if self.pending.len() > MAX_LINE {
                return Err(ReadError::Malformed(format!("a message over {MAX_LINE} bytes")));
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(ReadError::TimedOut);
            }
            keep_waiting().map_err(ReadError::Abandoned)?;
        }
    }
}

/// Worker side: connect to the runner and say hello.
pub fn connect(role: &str, implementation: &str) -> Result<Conn, String> {
    let path = std::env::var("RELAX_WORKER_SOCKET")
        .map_err(|_| "RELAX_WORKER_SOCKET is not set: workers are started by relax-colocate run".to_string())?;
    let stream = UnixStream::connect(&path).map_err(|e| format!("cannot connect to {path}: {e}"))?;
    let mut conn = Conn::new(stream).map_err(|e| e.to_string())?;
    let hello = Hello {
        protocol: PROTOCOL,
        role: role.into(),
        pid: Some(std::process::id()),
        implementation: Some(implementation.into()),
        transports: vec!["ipc".into(), "broadcast".into()],
    };
    conn.send(&serde_json::to_value(HelloMsg { hello }).expect("serializes")).map_err(|e| e.to_string())?;
    Ok(conn)
}

/// Worker side: serve requests until `shutdown` or the runner goes away.
pub fn serve(conn: &mut Conn, mut handle: impl FnMut(&str, &Value) -> Result<Value, (String, String)>) {
    loop {
        let msg = match conn.recv(None, || Ok(())) {
            Ok(m) => m,
            Err(_) => return,
        };
        // A request that does not read is answered as an unknown method.
        let Request { id, method, params } =
            decode(msg).unwrap_or(Request { id: Value::Null, method: String::new(), params: Value::Null });
        let params = if params.is_null() { Value::Object(Default::default()) } else { params };
        let reply = match handle(&method, &params) {
            Ok(result) => Response { id, result: Some(result), error: None },
            Err((kind, message)) => {
                Response { id, result: None, error: Some(ErrorBody { kind, message: Some(message) }) }
            }
        };
        if conn.send(&serde_json::to_value(reply).expect("serializes")).is_err() || method == Shutdown::NAME {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_send_to_a_peer_that_reads_nothing_ends_at_the_deadline_or_when_abandoned() {
        let (ours, _theirs) = UnixStream::pair().unwrap();
        let mut conn = Conn::new(ours).unwrap();
        // Larger than any socket buffer: the peer never reads, so the write can never finish.
        let big = json!({"id": 1, "method": "train", "params": "x".repeat(2 << 20)});
        let t0 = Instant::now();
        let r = conn.send_within(&big, t0 + Duration::from_millis(300), || Ok(()));
        assert!(matches!(r, Err(ReadError::TimedOut)), "{r:?}");
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        let t0 = Instant::now();
        let r = conn.send_within(&big, t0 + Duration::from_secs(60), || Err("interrupted (SIGTERM)".into()));
        assert!(matches!(r, Err(ReadError::Abandoned(ref why)) if why == "interrupted (SIGTERM)"), "{r:?}");
        assert!(t0.elapsed() < Duration::from_millis(1500), "{:?}", t0.elapsed());
    }

    #[test]
    fn a_send_within_reaches_a_reading_peer_whole() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let mut conn = Conn::new(ours).unwrap();
        let reader = std::thread::spawn(move || Conn::new(theirs).unwrap().recv(None, || Ok(())).unwrap());
        let big = json!({"id": 2, "params": "y".repeat(4 << 20)});
        conn.send_within(&big, Instant::now() + Duration::from_secs(60), || Ok(())).unwrap();
        assert_eq!(reader.join().unwrap(), big);
    }
}
