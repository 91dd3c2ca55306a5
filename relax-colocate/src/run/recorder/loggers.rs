//! Optional metric loggers (`--logger tensorboard,wandb`): every metrics row also goes to
//! TensorBoard event files under the run directory and/or to wandb.
//!
//! TensorBoard's format is small enough to write here (TFRecord framing with masked CRC32C around
//! `Event`/`Summary` protobufs with scalar values), so that logger needs no Python. wandb has no
//! such format: rows go as JSON lines to a small Python helper that calls `wandb.log`, found only
//! when the `wandb` package is installed.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::io::{BufWriter, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Sender;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LoggerKind {
    Tensorboard,
    Wandb,
}

/// Reads `metrics.loggers` ("", "tensorboard", "tensorboard,wandb").
pub fn parse_list(s: &str) -> Result<Vec<LoggerKind>, String> {
    let mut out = Vec::new();
    for item in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
        let kind = match item {
            "tensorboard" => LoggerKind::Tensorboard,
            "wandb" => LoggerKind::Wandb,
            other => {
                return Err(format!(
                    "metrics.loggers: unknown logger {other:?}; expected tensorboard and/or wandb, e.g. \
                     --logger tensorboard,wandb"
                ));
            }
        };
        if !out.contains(&kind) {
            out.push(kind);
        }
    }
    Ok(out)
}

/// Checks, before the run starts, that each logger can work: wandb needs its Python package.
/// The error names the install command (a configuration error: exit 2).
pub fn preflight(kinds: &[LoggerKind], python: &str) -> Result<(), String> {
    if kinds.contains(&LoggerKind::Wandb) {
        let probe = Command::new(python)
            .args(["-c", "import wandb"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        match probe {
            Ok(s) if s.success() => {}
            Ok(_) => {
                return Err(format!(
                    "--logger wandb needs the wandb Python package, which {python} cannot import: \
                     run `{python} -m pip install wandb` (or choose the interpreter with --set metrics.python=PATH)"
                ));
            }
            Err(e) => {
                return Err(format!(
                    "--logger wandb runs a Python helper, but {python:?} cannot be started ({e}): install Python 3 \
                     with `pip install wandb`, or set metrics.python to its path"
                ));
            }
        }
    }
    Ok(())
}

/// The loggers of one run.
pub struct Loggers {
    tensorboard: Option<EventWriter>,
    wandb: Option<Wandb>,
    /// Why a logger stopped, said once: a logger that fails does not stop the run.
    pub warnings: Vec<String>,
}

impl Loggers {
    pub fn none() -> Loggers {
        Loggers { tensorboard: None, wandb: None, warnings: Vec::new() }
    }

    pub fn open(kinds: &[LoggerKind], run_dir: &Path, python: &str, project: &str) -> Result<Loggers, String> {
        let mut l = Loggers::none();
        for k in kinds {
            match k {
                LoggerKind::Tensorboard => {
                    let dir = run_dir.join("tensorboard");
                    l.tensorboard = Some(
                        EventWriter::create(&dir)
                            .map_err(|e| format!("cannot write TensorBoard events in {}: {e}", dir.display()))?,
                    );
                }
                LoggerKind::Wandb => l.wandb = Some(Wandb::start(run_dir, python, project)?),
            }
        }
        Ok(l)
    }

    /// Where the loggers write, for the start-up note.
    pub fn describe(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(tb) = &self.tensorboard {
            v.push(format!("TensorBoard events: {} (tensorboard --logdir DIR)", tb.path().display()));
        }
        if self.wandb.is_some() {
            v.push("wandb: logging through the Python helper (its output: logs/wandb.log)".into());
        }
        v
    }

    /// Hands one rendered metrics row to every logger.
    pub fn log(&mut self, row: &Map<String, Value>) {
        let step = row.get("step").and_then(Value::as_i64).unwrap_or(0);
        if let Some(tb) = &mut self.tensorboard {
            let scalars: Vec<(&str, f32)> = row
                .iter()
                .filter(|(k, _)| *k != "step")
                .filter_map(|(k, v)| Some((k.as_str(), v.as_f64()? as f32)))
                .collect();
            if let Err(e) = tb.scalars(step, wall_time(), &scalars) {
                self.warnings.push(format!("TensorBoard logging stopped: {e}"));
                self.tensorboard = None;
            }
        }
        if let Some(w) = &mut self.wandb
            && let Err(e) = w.log(row)
        {
            self.warnings.push(format!("wandb logging stopped: {e} (see logs/wandb.log)"));
            if let Some(w) = self.wandb.take() {
                // Reaps the exited helper.
                let _ = w.finish();
            }
        }
    }

    /// Flushes the event file and lets wandb finish (sync or write its offline run).
    pub fn finish(&mut self) {
        if let Some(mut tb) = self.tensorboard.take()
            && let Err(e) = tb.flush()
        {
            self.warnings.push(format!("TensorBoard events: {e}"));
        }
        if let Some(w) = self.wandb.take()
            && let Err(e) = w.finish()
        {
            self.warnings.push(format!("wandb: {e} (see logs/wandb.log)"));
        }
    }
}

fn wall_time() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

// ---- TensorBoard event files ----

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum TFRecord uses.
const CRC32C_TABLE: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ 0x82F6_3B78 } else { c >> 1 };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
};

pub fn crc32c(data: &[u8]) -> u32 {
    !data.iter().fold(!0u32, |c, b| CRC32C_TABLE[((c ^ u32::from(*b)) & 0xff) as usize] ^ (c >> 8))
}

/// TFRecord stores CRCs masked, so that a CRC over data holding CRCs stays well distributed.
pub fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn bytes_field(out: &mut Vec<u8>, field: u32, data: &[u8]) {
    varint(out, u64::from(field << 3 | 2));
    varint(out, data.len() as u64);
    out.extend_from_slice(data);
}

/// `tensorflow.Event` with either `file_version` or a `Summary` of simple scalar values (the
/// fields TensorBoard's scalar plugin reads: wall_time = 1, step = 2, file_version = 3,
/// summary = 5; Summary.value = 1; Value.tag = 1, Value.simple_value = 2).
fn event(wall: f64, step: i64, file_version: Option<&str>, scalars: &[(&str, f32)]) -> Vec<u8> {
    let mut e = Vec::new();
    e.push(1 << 3 | 1);
    e.extend_from_slice(&wall.to_le_bytes());
    e.push(2 << 3);
    varint(&mut e, step as u64);
    if let Some(v) = file_version {
        bytes_field(&mut e, 3, v.as_bytes());
    }
    if !scalars.is_empty() {
        let mut summary = Vec::new();
        for (tag, v) in scalars {
            let mut value = Vec::new();
            bytes_field(&mut value, 1, tag.as_bytes());
            value.push(2 << 3 | 5);
            value.extend_from_slice(&v.to_le_bytes());
            bytes_field(&mut summary, 1, &value);
        }
        bytes_field(&mut e, 5, &summary);
    }
    e
}

/// Writes `events.out.tfevents.<time>.<host>` as TensorBoard's own writers do.
pub struct EventWriter {
    path: PathBuf,
    out: BufWriter<std::fs::File>,
}

impl EventWriter {
    pub fn create(dir: &Path) -> std::io::Result<EventWriter> {
        std::fs::create_dir_all(dir)?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .ok()
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "localhost".into());
        let secs = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let path = dir.join(format!("events.out.tfevents.{secs}.{host}"));
        let mut w = EventWriter { out: BufWriter::new(std::fs::File::create(&path)?), path };
        w.record(&event(wall_time(), 0, Some("brain.Event:2"), &[]))?;
        w.flush()?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn scalars(&mut self, step: i64, wall: f64, scalars: &[(&str, f32)]) -> std::io::Result<()> {
        self.record(&event(wall, step, None, scalars))?;
        // A row per step: flushing each keeps TensorBoard current while the run goes.
        self.flush()
    }

    fn record(&mut self, data: &[u8]) -> std::io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        self.out.write_all(&len)?;
        self.out.write_all(&masked_crc(&len).to_le_bytes())?;
        self.out.write_all(data)?;
        self.out.write_all(&masked_crc(data).to_le_bytes())
    }

    pub fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

// ---- wandb ----

const WANDB_HELPER: &str = include_str!("wandb_logger.py");

/// The Python helper that owns the wandb run; rows go to its stdin as JSON lines, written by a
/// thread so that a helper that stops reading (wandb.init waiting on the network) never holds
/// up a step.
struct Wandb {
    child: Child,
    tx: Option<Sender<String>>,
    writer: Option<JoinHandle<()>>,
}

impl Wandb {
    fn start(run_dir: &Path, python: &str, project: &str) -> Result<Wandb, String> {
        let logs = run_dir.join("logs");
        let _ = std::fs::create_dir_all(&logs);
        let log = std::fs::File::create(logs.join("wandb.log")).map_err(|e| format!("logs/wandb.log: {e}"))?;
        let log2 = log.try_clone().map_err(|e| e.to_string())?;
        let name = run_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let mut cmd = Command::new(python);
        cmd.args(["-u", "-c", WANDB_HELPER])
            .arg(run_dir)
            .arg(project)
            .arg(name)
            .stdin(Stdio::piped())
            .stdout(log)
            .stderr(log2);
        // Its own process group: Ctrl-C on the terminal reaches the runner only, which then
        // closes the helper's input so that wandb finishes the run cleanly.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let mut child = cmd.spawn().map_err(|e| format!("cannot start the wandb helper with {python:?}: {e}"))?;
        let mut stdin = child.stdin.take().ok_or("the wandb helper has no input pipe")?;
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let writer = std::thread::spawn(move || {
            for line in rx {
                if writeln!(stdin, "{line}").and_then(|_| stdin.flush()).is_err() {
                    // The helper is gone; its exit status and log say why at finish.
                    return;
                }
            }
        });
        Ok(Wandb { child, tx: Some(tx), writer: Some(writer) })
    }

    fn log(&mut self, row: &Map<String, Value>) -> Result<(), String> {
        if let Ok(Some(status)) = self.child.try_wait() {
            return Err(format!("the helper exited with {status}"));
        }
        let tx = self.tx.as_ref().ok_or("the helper's input is closed")?;
        tx.send(Value::Object(row.clone()).to_string()).map_err(|_| "the helper's input is closed".to_string())
    }

    /// Closes the helper's input (it then calls wandb.finish) and waits for it, a bounded time:
    /// an online run that cannot reach the server must not hold the runner.
    fn finish(mut self) -> Result<(), String> {
        drop(self.tx.take());
        let deadline = Instant::now() + Duration::from_secs(120);
        let result = loop {
            match self.child.try_wait() {
                Ok(Some(s)) if s.success() => break Ok(()),
                Ok(Some(s)) => break Err(format!("the helper exited with {s}")),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
                Ok(None) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break Err("wandb.finish took over 120 s; the helper was stopped (WANDB_MODE=offline keeps \
                               the run local)"
                        .into());
                }
                Err(e) => break Err(e.to_string()),
            }
        };
        // The helper has exited, so a write the thread is blocked in has failed and it returns.
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_varint(b: &[u8], at: &mut usize) -> u64 {
        let (mut v, mut shift) = (0u64, 0);
        loop {
            let byte = b[*at];
            *at += 1;
            v |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return v;
            }
            shift += 7;
        }
    }

    /// Fields of one protobuf message: (field number, wire type, payload).
    fn fields(b: &[u8]) -> Vec<(u64, u64, Vec<u8>)> {
        let mut at = 0;
        let mut out = Vec::new();
        while at < b.len() {
            let key = read_varint(b, &mut at);
            let (field, wire) = (key >> 3, key & 7);
            let payload = match wire {
                0 => read_varint(b, &mut at).to_le_bytes().to_vec(),
                1 => {
                    at += 8;
                    b[at - 8..at].to_vec()
                }
                2 => {
                    let n = read_varint(b, &mut at) as usize;
                    at += n;
                    b[at - n..at].to_vec()
                }
                5 => {
                    at += 4;
                    b[at - 4..at].to_vec()
                }
                w => panic!("wire type {w}"),
            };
            out.push((field, wire, payload));
        }
        out
    }

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // The CRC-32C check value of "123456789" (RFC 3720, iSCSI).
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn event_file_reads_back_with_valid_crcs_and_scalars() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.scalars(7, 1.5e9, &[("rollout/raw_reward", 0.625), ("memory/trainer-0/weights/sleep_bytes", 0.0)]).unwrap();
        w.flush().unwrap();
        let name = w.path().file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        let data = std::fs::read(w.path()).unwrap();
        let mut records = Vec::new();
        let mut at = 0;
        while at < data.len() {
            let len_bytes = &data[at..at + 8];
            let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
            let len_crc = u32::from_le_bytes(data[at + 8..at + 12].try_into().unwrap());
            assert_eq!(len_crc, masked_crc(len_bytes), "length CRC of record {}", records.len());
            let body = &data[at + 12..at + 12 + len];
            let body_crc = u32::from_le_bytes(data[at + 12 + len..at + 16 + len].try_into().unwrap());
            assert_eq!(body_crc, masked_crc(body), "data CRC of record {}", records.len());
            records.push(body.to_vec());
            at += 16 + len;
        }
        assert_eq!(records.len(), 2);
        let first = fields(&records[0]);
        assert!(first.iter().any(|(f, _, p)| *f == 3 && p == b"brain.Event:2"));
        let second = fields(&records[1]);
        let step = second.iter().find(|(f, _, _)| *f == 2).unwrap();
        assert_eq!(u64::from_le_bytes(step.2.clone().try_into().unwrap()), 7);
        let wall = second.iter().find(|(f, w, _)| *f == 1 && *w == 1).unwrap();
        assert_eq!(f64::from_le_bytes(wall.2.clone().try_into().unwrap()), 1.5e9);
        let summary = &second.iter().find(|(f, _, _)| *f == 5).unwrap().2;
        let values: Vec<(String, f32)> = fields(summary)
            .into_iter()
            .map(|(_, _, v)| {
                let f = fields(&v);
                let tag = String::from_utf8(f.iter().find(|x| x.0 == 1).unwrap().2.clone()).unwrap();
                let val =
                    f32::from_le_bytes(f.iter().find(|x| x.0 == 2 && x.1 == 5).unwrap().2.clone().try_into().unwrap());
                (tag, val)
            })
            .collect();
        assert_eq!(values[0], ("rollout/raw_reward".to_string(), 0.625));
        assert_eq!(values.len(), 2);
    }

    #[test]
    fn logger_lists_parse() {
        assert_eq!(parse_list("").unwrap(), vec![]);
        assert_eq!(parse_list("wandb, tensorboard,wandb").unwrap(), vec![LoggerKind::Wandb, LoggerKind::Tensorboard]);
        assert!(parse_list("tb").unwrap_err().contains("tensorboard"));
    }

    #[test]
    fn missing_python_is_a_clear_error() {
        let e = preflight(&[LoggerKind::Wandb], "/nonexistent/python3").unwrap_err();
        assert!(e.contains("pip install wandb"), "{e}");
        assert!(preflight(&[LoggerKind::Tensorboard], "/nonexistent/python3").is_ok());
    }
}
