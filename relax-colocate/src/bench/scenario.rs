//! What a bench scenario is: a progress line, a run that measures (in worker processes) and
//! prints its tables, the figures results.json keeps under its key, its targets judged on figures
//! of the same run, and its plots.

use super::options::{DeviceKind, Options};
use super::spawn::Env;
use super::table::Target;
use crate::vendor::ApiKind;
use serde_json::{Map, Value};
use std::path::Path;

/// What every scenario runs with.
pub(super) struct Bench<'a> {
    pub env: Env,
    pub device: DeviceKind,
    pub api: ApiKind,
    pub opts: &'a Options,
}

impl Bench<'_> {
    pub fn quick(&self) -> bool {
        self.opts.quick
    }
}

/// Every scenario's figures, by results.json key.
pub(super) type Results = Map<String, Value>;

pub(super) struct About {
    /// results.json's key for its figures.
    pub key: &'static str,
    /// What the progress line says it does.
    pub step: &'static str,
}

pub(super) trait Scenario {
    fn about(&self) -> About;
    /// Measures and prints its tables; returns its figures.
    fn run(&mut self, bench: &Bench) -> Result<Value, String>;
    /// Its targets, judged on this run's figures (its own and others', by key).
    fn targets(&self, _results: &Results) -> Vec<Target> {
        Vec::new()
    }
    /// Its plots, written beside results.json.
    fn plot(&self, _out: &Path, _results: &Results) -> std::io::Result<()> {
        Ok(())
    }
}
