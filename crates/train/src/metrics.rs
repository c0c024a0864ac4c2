//! Metrics: one JSON object per step appended to `metrics.jsonl` (flushed every line, so a killed
//! run keeps what it logged), the same scalars as TensorBoard event files (`tensorboard --logdir
//! OUT/tensorboard`, or `wandb sync --sync-tensorboard`), and the process's memory as Linux
//! reports it.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::{Map, Value};

use crate::error::{io, Result};

/// One record: metric names (`train/loss`, `time/step_s`, ...) to values, in insertion order.
pub type Record = Map<String, Value>;

/// Appends records to a JSONL file and, when asked, to a TensorBoard event file.
pub struct MetricsLog {
    path: PathBuf,
    /// `None`: a log that keeps nothing (the ranks other than 0 of a data-parallel run).
    file: Option<BufWriter<File>>,
    events: Option<(PathBuf, syntaxdot_summary::SummaryWriter<BufWriter<File>>)>,
}

impl MetricsLog {
    /// Creates (or, `append`, continues) `dir/metrics.jsonl`.
    pub fn open(dir: &Path, append: bool) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        Self::open_file(&dir.join("metrics.jsonl"), append)
    }

    /// Creates (or, `append`, continues) the JSONL file `path`.
    pub fn open_file(path: &Path, append: bool) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(path)
            .map_err(io(path))?;
        Ok(Self { path: path.into(), file: Some(BufWriter::new(file)), events: None })
    }

    /// Also writes every record's numbers as TensorBoard scalars (tag: the metric's name, step:
    /// the record's `step`) into a new event file in `dir`. A resumed run starts a new file; the
    /// records it redoes then appear twice in TensorBoard, once per file.
    pub fn with_tensorboard(mut self, dir: &Path) -> Result<Self> {
        if self.file.is_none() {
            return Ok(self);
        }
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let writer = syntaxdot_summary::SummaryWriter::from_prefix(dir.join("events")).map_err(io(dir))?;
        self.events = Some((dir.to_path_buf(), writer));
        Ok(self)
    }

    /// Continues `dir/metrics.jsonl` after step `step`: the records of later steps (logged by a
    /// run killed after its last checkpoint) are dropped, so the resumed run logs them again.
    pub fn resume(dir: &Path, step: usize) -> Result<Self> {
        Self::resume_file(&dir.join("metrics.jsonl"), step)
    }

    /// [`MetricsLog::resume`] for the JSONL file `path`.
    pub fn resume_file(path: &Path, step: usize) -> Result<Self> {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let kept: String = text
            .lines()
            .filter(|l| {
                serde_json::from_str::<Value>(l)
                    .ok()
                    .and_then(|v| v.get("step").and_then(Value::as_u64))
                    .is_some_and(|s| s as usize <= step)
            })
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(path, kept).map_err(io(path))?;
        Self::open_file(path, true)
    }

    /// A log that writes nothing: every rank but 0 of a data-parallel run computes the same
    /// records and leaves the files to rank 0.
    pub fn discard() -> Self {
        Self { path: PathBuf::new(), file: None, events: None }
    }

    pub fn write(&mut self, record: &Record) -> Result<()> {
        let Some(file) = &mut self.file else { return Ok(()) };
        let line = serde_json::to_string(record).expect("a JSON map serialises");
        writeln!(file, "{line}").and_then(|_| file.flush()).map_err(io(&self.path))?;
        if let Some((dir, events)) = &mut self.events {
            let step = record.get("step").and_then(Value::as_i64).unwrap_or(0);
            for (key, value) in record.iter().filter(|(k, _)| k.as_str() != "step") {
                if let Some(v) = value.as_f64() {
                    events.write_scalar(key.as_str(), step, v as f32).map_err(io(dir.as_path()))?;
                }
            }
        }
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// A `kB` field of /proc/self/status, in bytes; 0 where /proc is not available.
fn status_bytes(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|kb| kb.parse::<u64>().ok()))
        })
        .map_or(0, |kb| kb * 1024)
}

/// The process's peak resident set size (`VmHWM`), in bytes.
pub fn peak_rss_bytes() -> u64 {
    status_bytes("VmHWM:")
}

/// Starts a new peak-RSS window (Linux: `5` to /proc/self/clear_refs resets `VmHWM` to the
/// current RSS).
pub fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// The process's resident set size now (`VmRSS`), in bytes.
pub fn rss_bytes() -> u64 {
    status_bytes("VmRSS:")
}

/// A record from a `json!({...})` object.
pub fn record(value: Value) -> Record {
    match value {
        Value::Object(m) => m,
        other => Record::from_iter([("value".to_string(), other)]),
    }
}

/// A compact terminal line of the named metrics present in `record`.
pub fn summary_line(record: &Record, names: &[(&str, &str)]) -> String {
    names
        .iter()
        .filter_map(|(key, label)| {
            record.get(*key).and_then(Value::as_f64).map(|v| {
                if v != 0.0 && (v.abs() < 1e-2 || v.abs() >= 1e5) {
                    format!("{label} {v:.2e}")
                } else {
                    format!("{label} {v:.4}")
                }
            })
        })
        .collect::<Vec<_>>()
        .join("  ")
}

/// Live-heap counters of a counting global allocator, which only a binary can install: with
/// one, the trainers also report the heap's peak per step, exact where RSS is blurred by what the
/// allocator keeps.
#[derive(Debug, Clone, Copy)]
pub struct HeapProbe {
    /// Bytes allocated now.
    pub live: fn() -> usize,
    /// The highest `live` since the last `reset_peak`.
    pub peak: fn() -> usize,
    pub reset_peak: fn(),
}

static HEAP_PROBE: OnceLock<HeapProbe> = OnceLock::new();

/// Installs the binary's heap counters (once; later calls are ignored).
pub fn install_heap_probe(probe: HeapProbe) {
    let _ = HEAP_PROBE.set(probe);
}

pub fn heap_probe() -> Option<&'static HeapProbe> {
    HEAP_PROBE.get()
}
