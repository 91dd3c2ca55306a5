//! `tms-ctl`: pause, resume and inspect processes running with libtms_hook.so, from outside.

use clap::{CommandFactory, Parser, Subcommand};
use serde::Serialize;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tms_proto::{ClientError, ErrorCode, OpReport, Request, Settings, SocketEntry, Status};

const AFTER_HELP: &str = "\
TARGET is a pid, a TMS_NAME (every process with that name), or a socket path.

Sockets live in $TMS_CONTROL_DIR, else $XDG_RUNTIME_DIR/tms (when $XDG_RUNTIME_DIR is ours and
0700), else /tmp/tms-$UID (override: --dir).
A hooked process serves one from its first region allocation or NCCL/HCCL communicator on
(TMS_CONTROL=1: from its first hooked call; TMS_CONTROL=0: never). Only the same user or root is served.

Processes are asked at the same time, each within --timeout: one that is stopped (SIGSTOP, a
debugger) or too busy is reported as not responding and delays the others by nothing.

Exit codes:
  0  success: every process asked answered, and every operation succeeded
  1  some process failed: an error reply (e.g. out of memory on resume; a managed process
     refusing a pause or resume without --force), or no answer within --timeout (stopped, busy,
     exited meanwhile); every other process was still served
  2  usage error, no process matches a TARGET, no process asked carries the --tag given (one that
     does not while another does is skipped, not failed), an empty --tag, or the socket folder is
     unsafe (another user's, or writable by others: tms-ctl says how to fix it)";

#[derive(Parser)]
#[command(name = "tms-ctl", version, about = "Pause, resume and inspect processes that run with libtms_hook.so", after_help = AFTER_HELP)]
struct Cli {
    /// Seconds each process has to answer, connect to reply (above 0, at most 86400); processes
    /// are asked at the same time.
    #[arg(long, global = true, default_value_t = 30.0)]
    timeout: f64,
    /// Socket folder (default: $TMS_CONTROL_DIR, $XDG_RUNTIME_DIR/tms, or /tmp/tms-$UID).
    #[arg(long, global = true)]
    dir: Option<PathBuf>,
    /// Machine-readable JSON output (stable field names).
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List hooked processes: pid, name, devices, bytes per tag and state, and their NCCL/HCCL
    /// communicators added up. Removes sockets of processes that are gone.
    List,
    /// Show one process (or all) in detail.
    Status {
        /// Processes to show: pids, TMS_NAMEs or socket paths (default: every hooked process).
        targets: Vec<String>,
    },
    /// Release the device memory of a tag (or every tag) in the given processes.
    Pause {
        /// Only this tag (default: every tag).
        #[arg(long)]
        tag: Option<String>,
        /// Every hooked process.
        #[arg(long)]
        all: bool,
        /// Also in a process that has a manager (a relax-colocate worker, a process started with
        /// TMS_MANAGED_BY): it refuses otherwise, since a pause from outside pulls memory from
        /// under its manager's next step.
        #[arg(long)]
        force: bool,
        /// Processes: pids, TMS_NAMEs (every process with that name) or socket paths.
        targets: Vec<String>,
    },
    /// Bring paused memory back at the same addresses, contents restored where backed up.
    Resume {
        /// Only this tag (default: every tag).
        #[arg(long)]
        tag: Option<String>,
        /// Every hooked process.
        #[arg(long)]
        all: bool,
        /// Also in a process that has a manager (a relax-colocate worker, a process started with
        /// TMS_MANAGED_BY): it refuses otherwise, since a pause from outside pulls memory from
        /// under its manager's next step.
        #[arg(long)]
        force: bool,
        /// Processes: pids, TMS_NAMEs (every process with that name) or socket paths.
        targets: Vec<String>,
    },
    /// Change a process's settings.
    Set {
        /// Free device memory a region allocation must leave, as TMS_MEMORY_MARGIN_BYTES (resume
        /// checks it too only with TMS_RESUME_KEEPS_MARGIN=1): bytes or a size such as 512MiB,
        /// 1GiB, 1GB (GB = 10^9 bytes); refused above the process's largest device.
        #[arg(long, value_parser = tms_proto::size::parse_size)]
        margin: Option<u64>,
        /// After a resume, keep handing out the last pause's CPU backup (get_cpu_backup), as
        /// TMS_RETAIN_CPU_BACKUP and torch_memory_saver's retain mode.
        #[arg(long)]
        retain_backup: Option<bool>,
        /// The CPU-backup flag of regions opened by threads that never set one, as
        /// TMS_INIT_ENABLE_CPU_BACKUP sets it at start.
        #[arg(long)]
        default_backup: Option<bool>,
        /// Every hooked process.
        #[arg(long)]
        all: bool,
        /// Processes: pids, TMS_NAMEs (every process with that name) or socket paths.
        targets: Vec<String>,
    },
    /// Check that processes answer.
    Ping {
        /// Every hooked process.
        #[arg(long)]
        all: bool,
        /// Processes: pids, TMS_NAMEs (every process with that name) or socket paths.
        targets: Vec<String>,
    },
    /// A live per-process, per-tag view, refreshed every --interval seconds (Ctrl-C to stop).
    Watch {
        /// Seconds between refreshes (fractions allowed, e.g. 0.5).
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
        /// Stop after this many refreshes (default: never); then exit 1 if a process did not
        /// answer one of them.
        #[arg(long)]
        count: Option<u64>,
    },
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions { shell: clap_complete::Shell },
    /// Print the manual page (roff; scripts/install.sh puts it in PREFIX/share/man/man1).
    Man,
}

/// A failure with the exit code it maps to.
struct Failure {
    code: u8,
    message: String,
}

fn usage(message: impl Into<String>) -> Failure {
    Failure { code: 2, message: message.into() }
}

fn main() -> ExitCode {
    // A reader that stops early (`tms-ctl list | head -1`) ends tms-ctl quietly, as it ends other
    // command-line tools, instead of a panic on the broken pipe.
    // SAFETY: restoring the default disposition of one signal before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let cli = Cli::parse();
    match run(&cli) {
        Ok(code) => ExitCode::from(code),
        Err(f) => {
            eprintln!("tms-ctl: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}

struct Ctx {
    dir: PathBuf,
    /// The folder was named with --dir (a missing one is then an error, not an empty machine).
    named_dir: bool,
    timeout: Duration,
    json: bool,
}

fn run(cli: &Cli) -> Result<u8, Failure> {
    const MAX_TIMEOUT_S: f64 = 86_400.0;
    if !(cli.timeout > 0.0 && cli.timeout <= MAX_TIMEOUT_S) {
        return Err(usage("--timeout must be a number of seconds above 0 and at most 86400 (a day)"));
    }
    let ctx = Ctx {
        named_dir: cli.dir.is_some(),
        dir: cli.dir.clone().unwrap_or_else(tms_proto::socket_dir),
        timeout: Duration::from_secs_f64(cli.timeout),
        json: cli.json,
    };
    match &cli.command {
        Command::List => list(&ctx),
        Command::Status { targets } => {
            let procs = if targets.is_empty() { alive(&ctx)? } else { resolve(&ctx, targets, false)? };
            show_status(&ctx, &procs)
        }
        Command::Pause { tag, all, force, targets } => {
            operate(&ctx, &resolve(&ctx, targets, *all)?, tag.as_deref(), true, *force)
        }
        Command::Resume { tag, all, force, targets } => {
            operate(&ctx, &resolve(&ctx, targets, *all)?, tag.as_deref(), false, *force)
        }
        Command::Set { margin, retain_backup, default_backup, all, targets } => {
            let settings =
                Settings { default_backup: *default_backup, margin_bytes: *margin, retain_backup: *retain_backup };
            if settings == Settings::default() {
                return Err(usage("nothing to set: give --margin, --retain-backup or --default-backup"));
            }
            simple(&ctx, &resolve(&ctx, targets, *all)?, &Request::Set(settings))
        }
        Command::Ping { all, targets } => simple(&ctx, &resolve(&ctx, targets, *all)?, &Request::Ping),
        Command::Watch { interval, count } => watch(&ctx, *interval, *count),
        Command::Completions { shell } => {
            clap_complete::generate(*shell, &mut Cli::command(), "tms-ctl", &mut std::io::stdout());
            Ok(0)
        }
        Command::Man => {
            tms_proto::manual::render(Cli::command(), &mut std::io::stdout())
                .map_err(|e| Failure { code: 1, message: format!("cannot write the manual page: {e}") })?;
            Ok(0)
        }
    }
}

/// Live sockets; stale ones (their process is gone) are removed. A folder another user could
/// have made or can write to is refused, saying so: a squatted folder would otherwise look
/// like a machine without hooked processes.
fn alive(ctx: &Ctx) -> Result<Vec<SocketEntry>, Failure> {
    match tms_proto::check_socket_dir(&ctx.dir) {
        Ok(()) => {}
        // The default folder appears with the first hooked process: none yet is no process. A
        // folder named with --dir that is not there is a mistake (a typo, another machine's path).
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !ctx.named_dir => return Ok(Vec::new()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(usage(format!(
                "the socket folder {} (--dir) does not exist; a run prints the folder its processes use, \
                 and without --dir tms-ctl looks in $TMS_CONTROL_DIR, $XDG_RUNTIME_DIR/tms or /tmp/tms-$UID",
                ctx.dir.display()
            )));
        }
        Err(e) => {
            return Err(usage(format!(
                "refusing the socket folder: {e}. Hooked processes do not serve a socket there either \
                 (their log says so)"
            )));
        }
    }
    // Name files whose socket went without them (a launcher removing its workers' sockets):
    // once their process is gone nothing else would remove them.
    for e in std::fs::read_dir(&ctx.dir).into_iter().flatten().flatten() {
        let sock = e.path().with_extension("sock");
        let Some(name) = sock.file_name().and_then(|n| n.to_str()) else { continue };
        if e.path().extension().is_some_and(|x| x == "name")
            && !sock.exists()
            && let Some((pid, start)) = tms_proto::parse_socket_name(name)
            && tms_proto::process_start_time(pid) != Some(start)
        {
            let _ = std::fs::remove_file(e.path());
        }
    }
    let (live, stale): (Vec<_>, Vec<_>) = tms_proto::list_sockets(&ctx.dir).into_iter().partition(|s| s.alive);
    for s in stale {
        let _ = std::fs::remove_file(tms_proto::name_file(&s.path));
        if std::fs::remove_file(&s.path).is_ok() && !ctx.json {
            eprintln!("tms-ctl: removed stale socket of exited pid {} ({})", s.pid, s.path.display());
        }
    }
    Ok(live)
}

/// Why a process gave no answer, in the words an operator acts on.
fn describe(pid: u32, e: &ClientError) -> String {
    match e {
        ClientError::Io(io) if io.kind() == std::io::ErrorKind::TimedOut => {
            let why = match tms_proto::process_state(pid) {
                Some('T' | 't') => format!(" (the process is stopped: `kill -CONT {pid}` resumes it)"),
                None | Some('Z' | 'X' | 'x') => " (the process exited)".to_string(),
                Some(_) => " (frozen or hung?)".to_string(),
            };
            format!("{io}{why}")
        }
        ClientError::Remote(p) if p.code == ErrorCode::Busy => {
            format!("{p}: the process is serving too many control connections; try again")
        }
        other => other.to_string(),
    }
}

type Ask<T> = Arc<dyn Fn(&Path) -> Result<T, ClientError> + Send + Sync>;

/// Asks every process at once and waits at most the timeout (plus a little) for all of them:
/// one that never answers costs its own row, not everyone's time. Results in `procs` order.
fn ask_all<T: Send + 'static>(ctx: &Ctx, procs: &[SocketEntry], ask: Ask<T>) -> Vec<Result<T, String>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let mut out: Vec<Option<Result<T, String>>> = procs.iter().map(|_| None).collect();
    for (i, p) in procs.iter().enumerate() {
        let (tx, mine, path, pid) = (tx.clone(), ask.clone(), p.path.clone(), p.pid);
        let work = move || {
            let r = mine(&path).map_err(|e| describe(pid, &e));
            let _ = tx.send((i, r));
        };
        if std::thread::Builder::new().name("tms-ctl-ask".into()).spawn(work).is_err() {
            out[i] = Some(ask(&p.path).map_err(|e| describe(p.pid, &e)));
        }
    }
    drop(tx);
    // The client's own deadline ends each call; the grace only covers scheduling.
    let deadline = Instant::now() + ctx.timeout + Duration::from_millis(500);
    while out.iter().any(Option::is_none) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((i, r)) => out[i] = Some(r),
            Err(_) => break,
        }
    }
    out.into_iter()
        .zip(procs)
        .map(|(r, p)| r.unwrap_or_else(|| Err(describe(p.pid, &ClientError::Io(tms_proto::timed_out(ctx.timeout))))))
        .collect()
}

fn resolve(ctx: &Ctx, targets: &[String], all: bool) -> Result<Vec<SocketEntry>, Failure> {
    if all && !targets.is_empty() {
        return Err(usage("give TARGETs or --all, not both"));
    }
    // A socket path is reached directly: the folder scan (and its ownership check, which a
    // root-owned folder fails for another user who may still be allowed the socket) is not
    // needed.
    let live =
        if !all && !targets.is_empty() && targets.iter().all(|t| t.contains('/')) { Vec::new() } else { alive(ctx)? };
    if all {
        if live.is_empty() {
            return Err(usage(format!("no hooked process has a socket in {}", ctx.dir.display())));
        }
        return Ok(live);
    }
    if targets.is_empty() {
        return Err(usage("no TARGET given (a pid, a TMS_NAME, a socket path, or --all)"));
    }
    let names = process_names(ctx, &live, targets);
    let mut out: Vec<SocketEntry> = Vec::new();
    for t in targets {
        let found = matching(t, &live, &names);
        if found.is_empty() {
            return Err(no_match(ctx, t, &live, &names));
        }
        for f in found {
            if !out.iter().any(|o| o.path == f.path) {
                out.push(f);
            }
        }
    }
    Ok(out)
}

/// A live process's TMS_NAME as far as `resolve` knows it: None when not looked up, Some(Ok(None))
/// when it has none, Some(Err) when asking it failed.
type ProcessName = Option<Result<Option<String>, String>>;

/// A target that is neither a socket path nor a pid: a TMS_NAME.
fn is_name(target: &str) -> bool {
    !target.contains('/') && target.parse::<u32>().is_err()
}

/// The names of `live`, in its order. Names come from the files beside the sockets; only
/// processes without one (older hooks) are asked, all at once and only when a target is a name,
/// so a stopped process delays a name lookup by one timeout at most and never one that does not
/// need it.
fn process_names(ctx: &Ctx, live: &[SocketEntry], targets: &[String]) -> Vec<ProcessName> {
    let mut names: Vec<ProcessName> = live.iter().map(|s| tms_proto::read_name(&s.path).map(Ok)).collect();
    if targets.iter().any(|t| is_name(t)) {
        let unknown: Vec<SocketEntry> =
            live.iter().zip(&names).filter(|(_, n)| n.is_none()).map(|(s, _)| s.clone()).collect();
        let timeout = ctx.timeout;
        let asked = ask_all(ctx, &unknown, Arc::new(move |p: &Path| tms_proto::status(p, timeout).map(|s| s.name)));
        let mut asked = asked.into_iter();
        for n in names.iter_mut().filter(|n| n.is_none()) {
            *n = asked.next();
        }
    }
    names
}

/// The processes one target names: a socket path when that file exists, else the live processes
/// with that pid or that name.
fn matching(t: &str, live: &[SocketEntry], names: &[ProcessName]) -> Vec<SocketEntry> {
    if t.contains('/') {
        let path = PathBuf::from(t);
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let (pid, start_time) = tms_proto::parse_socket_name(&name).unwrap_or((0, 0));
        if path.exists() { vec![SocketEntry { path, pid, start_time, alive: true }] } else { vec![] }
    } else if let Ok(pid) = t.parse::<u32>() {
        live.iter().filter(|s| s.pid == pid).cloned().collect()
    } else {
        live.iter()
            .zip(names)
            .filter(|(_, n)| matches!(n, Some(Ok(Some(name))) if name == t))
            .map(|(s, _)| s.clone())
            .collect()
    }
}

/// Why nothing matched `t`: a name may belong to a process that could not be asked (exit 1, a
/// failure to reach); otherwise the target is wrong (a usage error).
fn no_match(ctx: &Ctx, t: &str, live: &[SocketEntry], names: &[ProcessName]) -> Failure {
    let unnamed: Vec<String> = live
        .iter()
        .zip(names)
        .filter_map(|(s, n)| match n {
            Some(Err(e)) => Some(format!("pid {}: {e}", s.pid)),
            _ => None,
        })
        .collect();
    if is_name(t) && !unnamed.is_empty() {
        return Failure {
            code: 1,
            message: format!(
                "no responding process is named {t:?}; the name of {} is unknown: {}",
                if unnamed.len() == 1 { "one process" } else { "some processes" },
                unnamed.join("; ")
            ),
        };
    }
    usage(format!("no hooked process matches {t:?} in {}; `tms-ctl list` shows the running ones", ctx.dir.display()))
}

fn human(bytes: u64) -> String {
    tms_proto::size::format_size(bytes)
}

#[derive(Serialize)]
struct ProcessRow {
    pid: u32,
    socket: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<Status>,
    /// The process's communicators added up, one entry per library ("nccl", "hccl"); absent
    /// when it has none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    communicators: Vec<CommSummary>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// One library's communicators in a process: how many, the bytes a pause of tag `nccl` can
/// release (HCCL's: none), the bytes that stay (HCCL's: all its buffers), and what is suspended now.
#[derive(Serialize, Debug, Default, PartialEq, Eq)]
struct CommSummary {
    library: String,
    count: u64,
    suspendable_bytes: u64,
    persistent_bytes: u64,
    suspended: u64,
    suspended_bytes: u64,
}

fn summarize(st: &Status) -> Vec<CommSummary> {
    let mut out: Vec<CommSummary> = Vec::new();
    for c in &st.communicators {
        let i = match out.iter().position(|s| s.library == c.library) {
            Some(i) => i,
            None => {
                out.push(CommSummary { library: c.library.clone(), ..Default::default() });
                out.len() - 1
            }
        };
        let s = &mut out[i];
        s.count += 1;
        s.suspendable_bytes += c.suspendable_bytes;
        s.persistent_bytes += c.persistent_bytes;
        if c.suspended {
            s.suspended += 1;
            s.suspended_bytes += c.suspendable_bytes;
        }
    }
    out
}

/// One line per library for the table: what its communicators hold and what a pause can win.
fn comm_line(s: &CommSummary) -> String {
    if s.library == "hccl" {
        format!(
            "{} hccl communicator(s): buffers {} (HCCL cannot release them; HCCL_BUFFSIZE sizes them)",
            s.count,
            human(s.persistent_bytes)
        )
    } else {
        format!(
            "{} {} communicator(s): suspendable {}, suspended {} ({}), persistent {}",
            s.count,
            printable(&s.library),
            human(s.suspendable_bytes),
            s.suspended,
            human(s.suspended_bytes),
            human(s.persistent_bytes)
        )
    }
}

fn collect(ctx: &Ctx, procs: &[SocketEntry]) -> Vec<ProcessRow> {
    let timeout = ctx.timeout;
    let answers = ask_all(ctx, procs, Arc::new(move |p: &Path| tms_proto::status(p, timeout)));
    procs
        .iter()
        .zip(answers)
        .map(|(p, r)| ProcessRow {
            pid: p.pid,
            socket: p.path.display().to_string(),
            error: r.as_ref().err().cloned(),
            communicators: r.as_ref().map(summarize).unwrap_or_default(),
            status: r.ok(),
        })
        .collect()
}

/// A name or tag as text a terminal shows as written: control characters (a newline that would
/// forge a table row, escape sequences) are printed escaped, `\n` or `\u{1b}`.
fn printable(text: &str) -> String {
    text.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() }).collect()
}

fn table(rows: &[ProcessRow]) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "{:<8} {:<18} {:<22} {:<14} {:>7} {:>11} {:>7} {:>11} {:>11}\n",
        "PID", "NAME", "DEVICE FREE/TOTAL", "TAG", "ACTIVE", "BYTES", "PAUSED", "BYTES", "BACKUP"
    ));
    for r in rows {
        let Some(st) = &r.status else {
            out.push_str(&format!("{:<8} (no answer: {})\n", r.pid, r.error.as_deref().unwrap_or("?")));
            continue;
        };
        let name = st.name.as_deref().map_or_else(|| "-".into(), printable);
        let dev = st
            .devices
            .first()
            .map(|d| format!("{}:{} {}/{}", d.vendor, d.device, human(d.free), human(d.total)))
            .unwrap_or_else(|| "-".into());
        if st.tags.is_empty() {
            out.push_str(&format!("{:<8} {:<18} {:<22} {:<14}\n", r.pid, name, dev, "(no tracked memory)"));
        }
        for (i, t) in st.tags.iter().enumerate() {
            let (pid, name, dev) =
                if i == 0 { (r.pid.to_string(), name.as_str(), dev.as_str()) } else { (String::new(), "", "") };
            out.push_str(&format!(
                "{:<8} {:<18} {:<22} {:<14} {:>7} {:>11} {:>7} {:>11} {:>11}\n",
                pid,
                name,
                dev,
                printable(&t.tag),
                t.allocations_active,
                human(t.bytes_active),
                t.allocations_paused,
                human(t.bytes_paused),
                human(t.backup_bytes)
            ));
        }
        for c in &r.communicators {
            out.push_str(&format!("{:<8} {:<18} {:<22} {}\n", "", "", "", comm_line(c)));
        }
    }
    out
}

fn list(ctx: &Ctx) -> Result<u8, Failure> {
    let rows = collect(ctx, &alive(ctx)?);
    if ctx.json {
        println!("{}", serde_json::to_string_pretty(&rows).expect("serializes"));
    } else if rows.is_empty() {
        println!("no hooked processes (sockets in {})", ctx.dir.display());
        if !ctx.named_dir {
            for (dir, n) in other_folders(&ctx.dir) {
                println!("  {n} serve in {} (a run's own folder): tms-ctl --dir {} list", dir.display(), dir.display());
            }
        }
    } else {
        print!("{}", table(&rows));
    }
    Ok(if rows.iter().any(|r| r.error.is_some()) { 1 } else { 0 })
}

/// Other socket folders of this user with live hooked processes, and how many: the default
/// folders, and the private ones `relax-colocate run` gives its workers (`<tmp>/relax-*/ctl`).
/// Read only: nothing there is reaped.
fn other_folders(searched: &Path) -> Vec<(PathBuf, usize)> {
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    let mut candidates = vec![
        tms_proto::socket_dir_from(None, std::env::var_os("XDG_RUNTIME_DIR"), uid),
        PathBuf::from(format!("/tmp/tms-{uid}")),
    ];
    let runs = std::fs::read_dir(std::env::temp_dir()).into_iter().flatten().flatten();
    candidates
        .extend(runs.filter(|e| e.file_name().to_string_lossy().starts_with("relax-")).map(|e| e.path().join("ctl")));
    candidates.sort();
    candidates.dedup();
    candidates
        .into_iter()
        .filter(|d| d != searched && tms_proto::check_socket_dir(d).is_ok())
        .map(|d| {
            let n = tms_proto::list_sockets(&d).into_iter().filter(|s| s.alive).count();
            (d, n)
        })
        .filter(|(_, n)| *n > 0)
        .collect()
}

fn show_status(ctx: &Ctx, procs: &[SocketEntry]) -> Result<u8, Failure> {
    let rows = collect(ctx, procs);
    if rows.is_empty() && !ctx.json {
        println!("no hooked processes (sockets in {})", ctx.dir.display());
        return Ok(0);
    }
    if ctx.json {
        println!("{}", serde_json::to_string_pretty(&rows).expect("serializes"));
    } else {
        for r in &rows {
            match &r.status {
                Some(st) => {
                    println!(
                        "pid {} ({}), hook {}, socket {}",
                        r.pid,
                        st.name.as_deref().map_or_else(|| "unnamed".into(), printable),
                        st.hook_version,
                        r.socket
                    );
                    for d in &st.devices {
                        println!("  {} device {}: {} free of {}", d.vendor, d.device, human(d.free), human(d.total));
                    }
                    if let Some(m) = &st.managed_by {
                        println!("  managed by {} (pause and resume from here need --force)", printable(m));
                    }
                    println!(
                        "  margin {}, retain backup {}, default backup {}, pinned buffers pooled {} (kept by resumed \
                         allocations for their next pause; paused contents are each tag's \"backup\" below)",
                        human(st.margin_bytes),
                        st.retain_backup,
                        st.default_backup,
                        human(st.pooled_backup_bytes)
                    );
                    if let Some(p) = &st.last_pause {
                        let tag =
                            p.tag.as_deref().map_or_else(|| "every tag".into(), |t| format!("tag {}", printable(t)));
                        println!("  last pause ({tag}): {}", op_summary("paused", p));
                    }
                    for t in &st.tags {
                        println!(
                            "  tag {:<14} active {} ({}), paused {} ({}), backup {}",
                            printable(&t.tag),
                            t.allocations_active,
                            human(t.bytes_active),
                            t.allocations_paused,
                            human(t.bytes_paused),
                            human(t.backup_bytes)
                        );
                    }
                    for c in st.communicators.iter().filter(|c| c.library == "hccl") {
                        println!(
                            "  hccl communicator {:#x} on device {}: buffers {}, cannot be released (HCCL_BUFFSIZE sizes them)",
                            c.handle,
                            c.device.map_or_else(|| "?".to_string(), |d| d.to_string()),
                            human(c.persistent_bytes)
                        );
                    }
                    for c in st.communicators.iter().filter(|c| c.library != "hccl") {
                        println!(
                            "  nccl communicator {:#x} on device {}: suspendable {}, persistent {}, {}",
                            c.handle,
                            c.device.map_or_else(|| "?".to_string(), |d| d.to_string()),
                            human(c.suspendable_bytes),
                            human(c.persistent_bytes),
                            match (c.suspended, c.suspended_by_tms) {
                                (false, _) => "active",
                                (true, true) => "suspended (tag nccl)",
                                (true, false) => "suspended by the application",
                            }
                        );
                    }
                }
                None => println!("pid {}: no answer: {}", r.pid, r.error.as_deref().unwrap_or("?")),
            }
        }
    }
    Ok(if rows.iter().any(|r| r.error.is_some()) { 1 } else { 0 })
}

#[derive(Serialize)]
struct OpRow {
    pid: u32,
    /// The process's TMS_NAME, where it set one.
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    socket: String,
    ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    report: Option<OpReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    /// Why the process was left alone (it carries no allocation of the tag asked for).
    #[serde(skip_serializing_if = "Option::is_none")]
    skipped: Option<String>,
}

fn operate(ctx: &Ctx, procs: &[SocketEntry], tag: Option<&str>, pause: bool, force: bool) -> Result<u8, Failure> {
    let verb = if pause { "paused" } else { "resumed" };
    if tag.is_some_and(|t| t.trim().is_empty()) {
        return Err(usage("--tag \"\" names no tag; leave --tag out to pause or resume every tag"));
    }
    let wanted = tag.map(String::from);
    let tag = wanted.clone();
    let request = if pause { Request::Pause { tag, force } } else { Request::Resume { tag, force } };
    let timeout = ctx.timeout;
    let answers = ask_all(ctx, procs, Arc::new(move |p: &Path| tms_proto::call_full(p, &request, timeout)));
    let mut rows = Vec::new();
    // Processes that carry no allocation of the tag: skipped where another process has it (one
    // `--all --tag kv_cache` reaches trainers too), an error where none has.
    let mut without_tag = 0;
    for (p, answer) in procs.iter().zip(answers) {
        let name = tms_proto::read_name(&p.path).flatten();
        let socket = p.path.display().to_string();
        let row = match answer {
            Ok((_, Some(e))) if e.code == ErrorCode::UnknownTag => {
                without_tag += 1;
                OpRow { pid: p.pid, name, socket, ok: true, report: None, error: None, skipped: Some(e.message) }
            }
            Ok((report, error)) => {
                let report: Option<OpReport> = report.and_then(|v| serde_json::from_value(v).ok());
                let ok = error.is_none();
                OpRow { pid: p.pid, name, socket, ok, report, error: error.map(|e| e.to_string()), skipped: None }
            }
            Err(e) => OpRow { pid: p.pid, name, socket, ok: false, report: None, error: Some(e), skipped: None },
        };
        if !ctx.json {
            let mut line = format!("{}: ", label(row.pid, row.name.as_deref()));
            if let Some(r) = &row.report {
                line.push_str(&op_summary(verb, r));
            }
            if let Some(e) = &row.error {
                line.push_str(&format!("{}error: {e}", if row.report.is_some() { "; " } else { "" }));
            }
            if let Some(why) = &row.skipped {
                line.push_str(&format!("skipped: {why}"));
            }
            println!("{line}");
        }
        rows.push(row);
    }
    if !rows.is_empty() && without_tag == rows.len() {
        if ctx.json {
            println!("{}", serde_json::to_string_pretty(&rows).expect("serializes"));
        }
        let t = wanted.unwrap_or_default();
        return Err(usage(format!(
            "no process asked has an allocation tagged {t:?}; `tms-ctl status` lists each process's tags"
        )));
    }
    if ctx.json {
        println!("{}", serde_json::to_string_pretty(&rows).expect("serializes"));
    }
    Ok(if rows.iter().all(|r| r.ok) { 0 } else { 1 })
}

/// What a pause or resume did, in one line: counts, time, device free memory, and the bytes its
/// backups copied and skipped (marked dead) where it had any.
fn op_summary(verb: &str, r: &OpReport) -> String {
    let mut line = format!(
        "{verb} {} allocations, {} in {:.1} ms (skipped {}, failed {}); device free {}",
        r.allocations_done,
        human(r.bytes_done),
        r.elapsed_ns as f64 / 1e6,
        r.allocations_skipped,
        r.allocations_failed,
        tms_proto::size::format_change(r.device_free_before, r.device_free_after)
    );
    if r.backup_bytes + r.backup_bytes_skipped > 0 {
        line += &format!(
            "; backup copied {}, skipped {} (marked dead)",
            human(r.backup_bytes),
            human(r.backup_bytes_skipped)
        );
    }
    line
}

/// How an output line names a process: its pid, and its TMS_NAME where it set one.
fn label(pid: u32, name: Option<&str>) -> String {
    match name {
        Some(name) => format!("pid {pid} ({name})"),
        None => format!("pid {pid}"),
    }
}

fn simple(ctx: &Ctx, procs: &[SocketEntry], request: &Request) -> Result<u8, Failure> {
    let timeout = ctx.timeout;
    let request = request.clone();
    let answers = ask_all(ctx, procs, Arc::new(move |p: &Path| tms_proto::call(p, &request, timeout)));
    let failed = answers.iter().any(Result::is_err);
    let mut rows = Vec::new();
    for (p, r) in procs.iter().zip(&answers) {
        let name = tms_proto::read_name(&p.path).flatten();
        if !ctx.json {
            let who = label(p.pid, name.as_deref());
            match r {
                Ok(_) => println!("{who}: ok"),
                Err(e) => println!("{who}: error: {e}"),
            }
        }
        rows.push(serde_json::json!({
            "pid": p.pid,
            "name": name,
            "socket": p.path.display().to_string(),
            "ok": r.is_ok(),
            "result": r.as_ref().ok(),
            "error": r.as_ref().err(),
        }));
    }
    if ctx.json {
        println!("{}", serde_json::to_string_pretty(&rows).expect("serializes"));
    }
    Ok(if failed { 1 } else { 0 })
}

fn watch(ctx: &Ctx, interval: f64, count: Option<u64>) -> Result<u8, Failure> {
    if !(interval > 0.0 && interval.is_finite()) {
        return Err(usage("--interval must be a positive number of seconds"));
    }
    let tty = std::io::stdout().is_terminal();
    let mut n = 0u64;
    // With --count, the exit says whether every process answered every refresh, as list's does.
    let mut unanswered = false;
    loop {
        let rows = collect(ctx, &alive(ctx)?);
        unanswered |= rows.iter().any(|r| r.error.is_some());
        if ctx.json {
            println!("{}", serde_json::to_string(&rows).expect("serializes"));
        } else {
            if tty {
                print!("\x1b[2J\x1b[H");
            }
            println!("tms-ctl watch: {} process(es), every {interval}s (Ctrl-C to stop)", rows.len());
            print!("{}", table(&rows));
        }
        let _ = std::io::stdout().flush();
        n += 1;
        if count.is_some_and(|c| n >= c) {
            return Ok(if unanswered { 1 } else { 0 });
        }
        std::thread::sleep(Duration::from_secs_f64(interval));
    }
}
