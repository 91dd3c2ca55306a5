//! Waiting on workers: requests over the worker protocol and calls to their tms control sockets,
//! each bounded by run.phase_timeout_s and interruptible; what a worker that stopped answering or
//! exited is named as; and stopping every worker at the end.

use super::{Fleet, Proc, Worker};
use crate::run::config::Config;
use crate::run::protocol::{self, Method, Request, Response, Shutdown};
use crate::run::signals::{interruption, signal_count};
use crate::run::{FailKind, R, Role, RunError, wire};
use serde_json::{Value, json};
use std::path::Path;
use std::time::{Duration, Instant};

/// A request sent with `submit` whose answer is still to be read.
#[derive(Debug)]
pub(in crate::run) struct InFlight {
    pub(in crate::run) worker: usize,
    id: u64,
    pub(in crate::run) method: &'static str,
    deadline: Instant,
}

impl InFlight {
    /// Whether its time is up (reading it now reports the timeout).
    pub(super) fn overdue(&self) -> bool {
        self.deadline <= Instant::now()
    }
}

/// How often a wait on a worker looks at the interruption flag: Ctrl-C and SIGTERM take effect
/// within this even while a worker never answers.
const POLL: Duration = Duration::from_millis(20);

/// `run.phase_timeout_s` as a duration; a huge value means "practically never", not a panic.
pub(in crate::run) fn phase_timeout(cfg: &Config) -> Duration {
    timeout_of(cfg.run.phase_timeout_s)
}

fn timeout_of(secs: f64) -> Duration {
    Duration::try_from_secs_f64(secs).unwrap_or(Duration::from_secs(365 * 86_400))
}

/// The scheduling state of `pid` from /proc/PID/stat, in words, for messages about a worker that
/// does not answer.
fn process_state(pid: u32) -> Option<&'static str> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let state = stat.get(stat.rfind(')')? + 2..)?.chars().next()?;
    Some(match state {
        'R' => "running",
        'S' => "sleeping",
        'D' => "in uninterruptible sleep (D: waiting on the kernel or a device)",
        'T' => "stopped (T: SIGSTOP or SIGTSTP; SIGCONT resumes it)",
        't' => "stopped by a debugger (t)",
        'Z' | 'X' | 'x' => "exited (zombie)",
        _ => "in an unknown state",
    })
}

impl Fleet {
    fn timeout(&self) -> Duration {
        timeout_of(self.timeout_s)
    }

    /// Worker `i` did not answer `what` within the phase timeout: say who it is, and what its
    /// process is doing (a stopped process looks exactly like a hung one from the socket).
    fn timed_out(&self, i: usize, what: &str) -> RunError {
        let w = &self.workers[i];
        let state = self.state_note(i);
        self.fail(
            FailKind::Timeout,
            Some(&w.name),
            format!(
                "timed out: the {} (pid {}) did not answer {what} within {}s (run.phase_timeout_s){state}",
                w.role.as_str(),
                w.pid,
                self.timeout_s
            ),
        )
    }

    /// What worker `i`'s process is doing, as a clause to append ("; its process is ...").
    pub(super) fn state_note(&self, i: usize) -> String {
        let w = &self.workers[i];
        // A process on another node cannot be looked at here; its node is what names it.
        match (w.proc.node(), process_state(w.pid)) {
            (Some(node), _) => format!("; it runs on {node} (launcher ray)"),
            (None, Some(s)) if s.starts_with("stopped") => format!("; its process is {s}"),
            (None, Some(s)) => format!("; its process is {s}: the worker may be hung"),
            (None, None) => String::new(),
        }
    }

    /// Runs `call` against the control socket of each worker in `targets`, in parallel, and
    /// waits for every answer until the phase timeout or an interruption. The calls run on
    /// threads of their own so the wait can end when a worker never answers: a SIGSTOPped process
    /// still accepts connections (the kernel queues them) and answers nothing. A thread left
    /// waiting ends at its own socket timeout, the same phase timeout.
    pub(super) fn control_calls<T: Send + 'static>(
        &self,
        targets: &[usize],
        what: &str,
        call: impl Fn(&Path, Duration) -> Result<T, tms_proto::ClientError> + Clone + Send + 'static,
    ) -> R<Vec<T>> {
        let timeout = self.timeout();
        let deadline = Instant::now() + timeout;
        let (tx, rx) = std::sync::mpsc::channel();
        for (k, &i) in targets.iter().enumerate() {
            let path = self.workers[i].control.clone().expect("control socket found");
            let tx = tx.clone();
            let call = call.clone();
            std::thread::spawn(move || {
                let _ = tx.send((k, call(&path, timeout)));
            });
        }
        drop(tx);
        let mut out: Vec<Option<T>> = targets.iter().map(|_| None).collect();
        let mut left = targets.len();
        while left > 0 {
            if let Some(why) = interruption() {
                return Err(self.fail(FailKind::Interrupted, None, why));
            }
            let Some(wait) = deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()) else {
                let k = out.iter().position(Option::is_none).expect("one is missing");
                return Err(self.timed_out(targets[k], what));
            };
            let (k, r) = match rx.recv_timeout(wait.min(POLL)) {
                Ok(got) => got,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => unreachable!("a call thread panicked"),
            };
            let i = targets[k];
            match r {
                Ok(v) => out[k] = Some(v),
                // The socket's own read timeout (EAGAIN, "os error 11") is the same timeout.
                Err(tms_proto::ClientError::Io(e))
                    if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) =>
                {
                    return Err(self.timed_out(i, what));
                }
                Err(e) => {
                    let name = self.workers[i].name.clone();
                    if let Some(cause) = self.remote_exit(i) {
                        return Err(self.fail(FailKind::Crash, Some(&name), cause));
                    }
                    return Err(self.fail(FailKind::Worker, Some(&name), format!("{what}: {e}")));
                }
            }
            left -= 1;
        }
        Ok(out.into_iter().map(|v| v.expect("every answer arrived")).collect())
    }

    /// Sends `M` to each worker in `targets` with its own params, then collects and reads the
    /// replies.
    pub(in crate::run) fn call_each<M: Method>(
        &mut self,
        targets: &[usize],
        params: Vec<M::Params>,
    ) -> R<Vec<M::Reply>> {
        let params = params.into_iter().map(|p| serde_json::to_value(p).expect("params serialize")).collect();
        let replies = self.exchange(targets, M::NAME, params)?;
        self.read_replies::<M>(targets, replies)
    }

    /// `M` with the same params to every worker of `role`.
    pub(in crate::run) fn call_all<M: Method>(&mut self, role: Role, params: M::Params) -> R<Vec<M::Reply>> {
        let targets = self.indices(role);
        let params = serde_json::to_value(params).expect("params serialize");
        let replies = self.exchange(&targets, M::NAME, vec![params; targets.len()])?;
        self.read_replies::<M>(&targets, replies)
    }

    /// Sends `M` to worker `i` and returns at once: the request is under way until `collect`
    /// reads its reply. Drivers that overlap workers (async mode) keep one request in flight per
    /// worker and learn from `wait_any` which answered.
    pub(in crate::run) fn submit<M: Method>(&mut self, i: usize, params: M::Params) -> R<InFlight> {
        let deadline = Instant::now() + self.timeout();
        let params = serde_json::to_value(params).expect("params serialize");
        let id = self.send_request(i, M::NAME, params, deadline)?;
        Ok(InFlight { worker: i, id, method: M::NAME, deadline })
    }

    /// Waits until one of `requests` has an answer to read, or one's time is up (its `collect`
    /// then reports the timeout), and returns its position; or gives up at `until` (None when it
    /// passed first). Interruptions end the wait.
    pub(in crate::run) fn wait_any_until(
        &mut self,
        requests: &[&InFlight],
        until: Option<Instant>,
    ) -> R<Option<usize>> {
        assert!(!requests.is_empty(), "waiting on no request");
        loop {
            if let Some(why) = interruption() {
                return Err(self.fail(FailKind::Interrupted, None, why));
            }
            let now = Instant::now();
            if let Some(k) = requests.iter().position(|r| r.deadline <= now) {
                return Ok(Some(k));
            }
            if until.is_some_and(|u| u <= now) {
                return Ok(None);
            }
            // A short look at each in turn: the first is looked at longest, which is fine for a
            // handful of workers and keeps this free of a poll set to maintain.
            let slice = POLL / requests.len().max(1) as u32;
            for (k, r) in requests.iter().enumerate() {
                let conn = self.workers[r.worker].conn.as_ref().expect("connected");
                if conn.readable(slice) {
                    return Ok(Some(k));
                }
            }
        }
    }

    /// Reads the answer to `request` as `M::Reply` (waiting for it if need be, up to its deadline).
    pub(in crate::run) fn collect<M: Method>(&mut self, request: InFlight) -> R<M::Reply> {
        assert_eq!(request.method, M::NAME, "collected as another method");
        let v = self.receive_result(request.worker, request.id, M::NAME, request.deadline)?;
        let mut replies = self.read_replies::<M>(&[request.worker], vec![v])?;
        Ok(replies.pop().expect("one reply"))
    }

    /// Each result as `M::Reply`: one that does not read fails the run naming the worker and the
    /// field.
    fn read_replies<M: Method>(&self, targets: &[usize], results: Vec<Value>) -> R<Vec<M::Reply>> {
        let read = |(&i, v): (&usize, Value)| {
            protocol::decode::<M::Reply>(v).map_err(|e| {
                let cause = format!("malformed {} reply: {e}", M::NAME);
                self.fail(FailKind::Worker, Some(&self.workers[i].name), cause)
            })
        };
        targets.iter().zip(results).map(read).collect()
    }

    /// Sends `method` to each worker in `targets` with its own params, then collects the results.
    fn exchange(&mut self, targets: &[usize], method: &str, params: Vec<Value>) -> R<Vec<Value>> {
        let deadline = Instant::now() + self.timeout();
        let mut ids = Vec::new();
        for (&i, p) in targets.iter().zip(params) {
            ids.push(self.send_request(i, method, p, deadline)?);
        }
        let mut out = Vec::new();
        for (&i, id) in targets.iter().zip(ids) {
            out.push(self.receive_result(i, id, method, deadline)?);
        }
        Ok(out)
    }

    /// Writes one request to worker `i`; returns its id.
    fn send_request(&mut self, i: usize, method: &str, params: Value, deadline: Instant) -> R<u64> {
        let w = &mut self.workers[i];
        w.next_id += 1;
        let id = w.next_id;
        let msg = Request { id: id.into(), method: method.into(), params };
        let msg = serde_json::to_value(msg).expect("requests serialize");
        let proc = &mut w.proc;
        let sent = w.conn.as_mut().expect("connected").send_within(&msg, deadline, || {
            if let Some(why) = interruption() {
                return Err(why);
            }
            proc.exited().map_or(Ok(()), Err)
        });
        match sent {
            Ok(()) => Ok(id),
            Err(wire::ReadError::TimedOut) => {
                Err(self.timed_out(i, &format!("{method} (it did not read the request)")))
            }
            Err(wire::ReadError::Abandoned(why)) if interruption().is_some() => {
                Err(self.fail(FailKind::Interrupted, None, why))
            }
            Err(e) => {
                let cause = self.exit_cause(i).unwrap_or_else(|| format!("cannot send {method}: {e}"));
                let name = self.workers[i].name.clone();
                Err(self.fail(FailKind::Crash, Some(&name), cause))
            }
        }
    }

    /// Reads worker `i`'s answer to request `id`: its result, or the run's error.
    fn receive_result(&mut self, i: usize, id: u64, method: &str, deadline: Instant) -> R<Value> {
        let name = self.workers[i].name.clone();
        let w = &mut self.workers[i];
        let proc = &mut w.proc;
        let reply = w.conn.as_mut().expect("connected").recv(Some(deadline), || {
            if let Some(why) = interruption() {
                return Err(why);
            }
            proc.exited().map_or(Ok(()), Err)
        });
        let reply = match reply {
            Ok(v) => v,
            Err(e) => return Err(self.read_failed(i, method, e)),
        };
        let reply: Response = match serde_json::from_value(reply) {
            Ok(r) => r,
            Err(e) => return Err(self.fail(FailKind::Worker, Some(&name), format!("protocol error: {e}"))),
        };
        if reply.id.as_u64() != Some(id) {
            return Err(self.fail(FailKind::Worker, Some(&name), format!("answered {} to request {id}", reply.id)));
        }
        if let Some(err) = reply.error {
            // "timeout": the worker waited for another past its limit (a collective's peer).
            let kind = match err.kind.as_str() {
                "oom" => FailKind::OutOfMemory,
                "timeout" => FailKind::Timeout,
                _ => FailKind::Worker,
            };
            let msg = err.message.as_deref().unwrap_or("(no message)");
            let mut e = self.fail(kind, Some(&name), format!("{method} failed ({}): {msg}", Value::from(err.kind)));
            if kind == FailKind::OutOfMemory {
                e.request = crate::run::summary::FailedRequest::find_in(msg).map(Box::new);
            }
            return Err(e);
        }
        Ok(reply.result.unwrap_or(Value::Null))
    }

    /// What a failed read of worker `i`'s answer means for the run.
    fn read_failed(&mut self, i: usize, method: &str, e: wire::ReadError) -> RunError {
        let name = self.workers[i].name.clone();
        match e {
            wire::ReadError::TimedOut => self.timed_out(i, method),
            wire::ReadError::Abandoned(why) if interruption().is_some() => self.fail(FailKind::Interrupted, None, why),
            wire::ReadError::Abandoned(why) => self.fail(FailKind::Crash, Some(&name), why),
            wire::ReadError::Closed => {
                let cause = self.wait_exit_cause(i);
                if let (None, Some(why)) = (&cause, interruption()) {
                    return self.fail(FailKind::Interrupted, None, why);
                }
                let cause = cause.unwrap_or_else(|| "closed its connection".into());
                self.fail(FailKind::Crash, Some(&name), cause)
            }
            e => self.fail(FailKind::Worker, Some(&name), format!("protocol error: {e}")),
        }
    }

    /// A remote worker whose control request failed may have died under it: its exit, as its node
    /// reports it (within a few seconds: it comes through the node's agent and the bridge).
    fn remote_exit(&self, i: usize) -> Option<String> {
        let Proc::Remote { exit_file, .. } = &self.workers[i].proc else { return None };
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Ok(cause) = std::fs::read_to_string(exit_file) {
                return Some(cause);
            }
            if Instant::now() > deadline || interruption().is_some() {
                return None;
            }
            std::thread::sleep(POLL);
        }
    }

    fn exit_cause(&mut self, i: usize) -> Option<String> {
        if let Some(cause) = self.workers[i].proc.exited() {
            return Some(cause);
        }
        // The bridge's end closes every remote worker's connection at once: name it, not them.
        self.bridge.as_mut().and_then(|b| b.exited())
    }

    fn wait_exit_cause(&mut self, i: usize) -> Option<String> {
        // A remote worker's end reaches the runner through its node's agent and the bridge.
        let tries = if self.workers[i].proc.node().is_some() { 100 } else { 40 };
        for _ in 0..tries {
            if let Some(c) = self.exit_cause(i) {
                return Some(c);
            }
            if interruption().is_some() {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// Waits up to `within` for every worker to exit. A signal that comes meanwhile (or a second
    /// one after the signal that ended the run) cuts the wait short: the user wants out now, and
    /// whatever is left gets SIGKILL.
    fn wait_for_exits(&mut self, within: Duration, signals_before: u32, running: fn(&mut Worker) -> bool) {
        let start = Instant::now();
        let mut told = false;
        while start.elapsed() < within && self.workers.iter_mut().any(running) {
            let signals = signal_count();
            if signals > signals_before || signals >= 2 {
                return;
            }
            if !told && start.elapsed() > Duration::from_secs(1) {
                // "again" only after the Ctrl-C that ended the run: a run that ended by itself had none.
                let again = if signals_before > 0 { " again" } else { "" };
                eprintln!("relax-colocate run: waiting for the workers to stop (Ctrl-C{again} kills them now)");
                told = true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops every worker: a graceful end asks each to shut down first; then SIGTERM, and SIGKILL
    /// 3 s later, to each process group; the bridge stops the remote ones.
    pub(in crate::run) fn stop(&mut self, graceful: bool) {
        let signals_before = signal_count();
        if graceful {
            for i in 0..self.workers.len() {
                let w = &mut self.workers[i];
                if let Some(c) = w.conn.as_mut() {
                    w.next_id += 1;
                    let msg = Request { id: w.next_id.into(), method: Shutdown::NAME.into(), params: json!({}) };
                    let _ = c.send(&serde_json::to_value(msg).expect("requests serialize"));
                }
            }
            self.wait_for_exits(Duration::from_secs(5), signals_before, |w| w.proc.exited().is_none());
        }
        for w in &mut self.workers {
            if let Proc::Local(child) = &mut w.proc
                && matches!(child.try_wait(), Ok(None))
            {
                // Each worker leads its own process group, so a shell wrapper's children go too.
                // A stopped process keeps SIGTERM pending until it continues: SIGCONT lets a
                // frozen worker end now rather than at the SIGKILL 3 s later.
                // SAFETY: signalling a process group we created.
                unsafe {
                    libc::kill(-(child.id() as i32), libc::SIGTERM);
                    libc::kill(-(child.id() as i32), libc::SIGCONT);
                }
            }
        }
        // Remote workers are the bridge's to stop (below).
        self.wait_for_exits(Duration::from_secs(3), signals_before, |w| match &mut w.proc {
            Proc::Local(c) => matches!(c.try_wait(), Ok(None)),
            Proc::Remote { .. } => false,
        });
        for w in &mut self.workers {
            if let Proc::Local(child) = &mut w.proc
                && matches!(child.try_wait(), Ok(None))
            {
                // SAFETY: as above.
                unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
                let _ = child.wait();
            }
            w.conn = None;
        }
        // The bridge stops every worker on every node (and a local cluster) before it exits.
        if let Some(b) = self.bridge.as_mut() {
            b.stop();
        }
        // A killed worker cannot remove its control socket; the folder is ours alone.
        for s in tms_proto::list_sockets(&self.scratch.ctl_dir) {
            let _ = std::fs::remove_file(s.path);
        }
    }
}

pub(in crate::run) fn describe_exit(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (_, Some(s)) => format!("was killed by signal {s} ({})", signal_name(s)),
        _ => "exited".into(),
    }
}

fn signal_name(s: i32) -> &'static str {
    match s {
        libc::SIGABRT => "SIGABRT: it aborted",
        libc::SIGSEGV => "SIGSEGV: it crashed",
        libc::SIGKILL => "SIGKILL: out of host memory or killed",
        libc::SIGTERM => "SIGTERM",
        libc::SIGBUS => "SIGBUS",
        _ => "signal",
    }
}
