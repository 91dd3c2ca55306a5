//! `--memory-profile`: the device allocations a real trainer and rollout engine make, by count and
//! size, so sleep / update_weights / wake_up are measured at realistic scale. Compute stays with
//! the small built-in policy; these allocations are filled, backed up, moved and checksummed.
//!
//! Shapes, per device with tensor parallelism `tp`:
//! - weights (trainer and rollout alike): one bf16 allocation per tensor of every layer (q, k, v,
//!   o, gate, up, down; k and v heads are not split below one per rank), the embedding and an
//!   untied LM head; tensors under 1 MiB (norms) share 2 MiB caching-allocator segments.
//! - trainer grads: an fp32 buffer of every parameter in 40M-element buckets (Megatron DDP).
//! - trainer optimizer: fp32 master weights, Adam m and v per tensor (not sharded across DP).
//! - rollout kv_cache: one K and one V buffer per layer (SGLang's token-pool layout), sized by
//!   the preset's KV budget per device; cuda_graph: graph-pool segments.

use serde::{Deserialize, Serialize};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

#[derive(Debug, Clone, Copy)]
pub struct Arch {
    pub layers: u64,
    pub hidden: u64,
    pub intermediate: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub vocab: u64,
    pub tied: bool,
    pub kv_cache: u64,
    pub graph_segments: u64,
    pub graph_segment: u64,
}

/// The presets; sizes from the models' published configurations.
pub fn preset(name: &str) -> Result<Option<Arch>, String> {
    let qwen3 = |layers, hidden, intermediate, heads, tied, kv_gib| Arch {
        layers,
        hidden,
        intermediate,
        heads,
        kv_heads: 8,
        head_dim: 128,
        vocab: 151_936,
        tied,
        kv_cache: kv_gib * GIB,
        graph_segments: 8,
        graph_segment: 64 * MIB,
    };
    Ok(Some(match name {
        "none" => return Ok(None),
        "tiny" => Arch {
            layers: 2,
            hidden: 512,
            intermediate: 1024,
            heads: 8,
            kv_heads: 4,
            head_dim: 64,
            vocab: 8192,
            tied: true,
            kv_cache: 96 * MIB,
            graph_segments: 4,
            graph_segment: 8 * MIB,
        },
        "qwen3-0.6b" => qwen3(28, 1024, 3072, 16, true, 16),
        "qwen3-4b" => qwen3(36, 2560, 9728, 32, true, 40),
        "qwen3-8b" => qwen3(36, 4096, 12288, 32, false, 36),
        // Qwen2.5-7B (and Qwen2.5-Math-7B, the same shape): 28 layers, 4 KV heads, untied, vocab
        // 152,064; its QKV biases (under 1 MiB a layer) are left out, as the norms' shapes are
        // kept. KV cache: 60 GiB, about what an H20's 96 GB leaves at vLLM's
        // gpu_memory_utilization 0.8 less the bf16 weights (15.2 GB).
        "qwen2.5-7b" => Arch {
            layers: 28,
            hidden: 3584,
            intermediate: 18944,
            heads: 28,
            kv_heads: 4,
            vocab: 152_064,
            ..qwen3(28, 3584, 18944, 28, false, 60)
        },
        other => {
            return Err(format!(
                "memory.profile {other:?} is not a preset; choose none, tiny, qwen3-0.6b, qwen3-4b, qwen3-8b or qwen2.5-7b"
            ));
        }
    }))
}

/// Allocation sizes per tag for one role on one device.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct RoleMemory {
    pub tags: Vec<(String, Vec<u64>)>,
}

impl RoleMemory {
    pub fn bytes(&self) -> u64 {
        self.tags.iter().flat_map(|(_, s)| s).sum()
    }

    pub fn tag_bytes(&self, tag: &str) -> u64 {
        self.tags.iter().filter(|(t, _)| t == tag).flat_map(|(_, s)| s).sum()
    }

    pub fn count(&self) -> usize {
        self.tags.iter().map(|(_, s)| s.len()).sum()
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Profile {
    pub trainer: RoleMemory,
    pub rollout: RoleMemory,
    pub params_per_device: u64,
    /// Bytes of K and V one token adds to the cache on one device (bf16, every layer): what a
    /// decode step reads per token of context.
    #[serde(default)]
    pub kv_bytes_per_token: u64,
    /// The rollout's KV cache on one device at full scale (memory.scale aside): with
    /// `kv_bytes_per_token`, the tokens an engine holds.
    #[serde(default)]
    pub kv_cache_bytes: u64,
}

fn weight_tensors(a: &Arch, tp: u64) -> Vec<u64> {
    let kv_per_rank = a.kv_heads.div_ceil(tp).max(1);
    let q = a.hidden * a.heads * a.head_dim / tp;
    let kv = a.hidden * kv_per_rank * a.head_dim;
    let o = q;
    let mlp = a.hidden * a.intermediate / tp;
    let mut elems = Vec::new();
    for _ in 0..a.layers {
        elems.extend([q, kv, kv, o, mlp, mlp, mlp]);
        // input and post-attention norms, q and k norms
        elems.extend([a.hidden, a.hidden, a.head_dim, a.head_dim]);
    }
    elems.push(a.vocab * a.hidden / tp);
    if !a.tied {
        elems.push(a.vocab * a.hidden / tp);
    }
    elems.push(a.hidden);
    elems
}

/// Packs tensors under 1 MiB into shared 2 MiB segments, as PyTorch's small pool does.
fn segments(bytes: impl Iterator<Item = u64>) -> Vec<u64> {
    let mut out = Vec::new();
    let mut small = 0u64;
    for b in bytes {
        if b >= MIB {
            out.push(b.div_ceil(2 * MIB) * 2 * MIB);
        } else {
            if small + b > 2 * MIB || small == 0 {
                out.push(2 * MIB);
                small = 0;
            }
            small += b;
        }
    }
    out
}

fn scaled(sizes: Vec<u64>, scale: f64) -> Vec<u64> {
    // 4 KiB floor so a scaled-down shape keeps its allocation count.
    sizes.into_iter().map(|s| (((s as f64) * scale) as u64).max(4096)).collect()
}

pub fn build(name: &str, tp: u32, scale: f64, kv_cache_gib: f64) -> Result<Profile, String> {
    let Some(a) = preset(name)? else { return Ok(Profile::default()) };
    let tp = tp as u64;
    let elems = weight_tensors(&a, tp);
    let params: u64 = elems.iter().sum();
    let weights = segments(elems.iter().map(|e| e * 2));
    let bucket = 40_000_000u64;
    let mut grads = vec![bucket * 4; (params / bucket) as usize];
    if !params.is_multiple_of(bucket) {
        grads.push((params % bucket) * 4);
    }
    let optimizer = segments(elems.iter().flat_map(|e| [e * 4, e * 4, e * 4]));
    let kv_total = if kv_cache_gib > 0.0 { (kv_cache_gib * GIB as f64) as u64 } else { a.kv_cache };
    let per_buffer = (kv_total / (2 * a.layers)).div_ceil(2 * MIB) * 2 * MIB;
    let kv = vec![per_buffer; (2 * a.layers) as usize];
    let graph = vec![a.graph_segment; a.graph_segments as usize];
    Ok(Profile {
        trainer: RoleMemory {
            tags: vec![
                ("weights".into(), scaled(weights.clone(), scale)),
                ("grads".into(), scaled(grads, scale)),
                ("optimizer".into(), scaled(optimizer, scale)),
            ],
        },
        rollout: RoleMemory {
            tags: vec![
                ("weights".into(), scaled(weights, scale)),
                ("kv_cache".into(), scaled(kv, scale)),
                ("cuda_graph".into(), scaled(graph, scale)),
            ],
        },
        params_per_device: params,
        kv_bytes_per_token: 2 * a.layers * a.kv_heads.div_ceil(tp).max(1) * a.head_dim * 2,
        kv_cache_bytes: per_buffer * 2 * a.layers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen3_4b_matches_its_parameter_count() {
        let p = build("qwen3-4b", 1, 1.0, 0.0).unwrap();
        // Qwen3-4B has about 4.0 billion parameters (tied embeddings).
        assert!((3.9e9..4.2e9).contains(&(p.params_per_device as f64)), "{}", p.params_per_device);
        let w = p.trainer.tag_bytes("weights") as f64;
        assert!((7.8e9..8.6e9).contains(&w), "{w}");
        // fp32 grads are twice the bf16 weights; master + m + v six times.
        let g = p.trainer.tag_bytes("grads") as f64;
        assert!((g / w - 2.0).abs() < 0.05, "{}", g / w);
        assert!((p.trainer.tag_bytes("optimizer") as f64 / w - 6.0).abs() < 0.2);
        assert_eq!(p.rollout.tags[1].1.len(), 72);
        // 36 layers x (K + V) x 8 KV heads x 128 x 2 bytes.
        assert_eq!(p.kv_bytes_per_token, 147_456);
        // The preset's 40 GiB of KV (each of its 72 buffers rounded up to 2 MiB): about 292k tokens.
        assert_eq!(p.kv_cache_bytes / p.kv_bytes_per_token, 291_840);
        // Tensor parallelism halves the big tensors.
        let tp2 = build("qwen3-4b", 2, 1.0, 0.0).unwrap();
        assert!(tp2.params_per_device < p.params_per_device * 55 / 100);
        // Qwen3-8B: about 8.2 billion, untied.
        let p8 = build("qwen3-8b", 1, 1.0, 0.0).unwrap();
        assert!((8.0e9..8.4e9).contains(&(p8.params_per_device as f64)), "{}", p8.params_per_device);
    }

    #[test]
    fn qwen2_5_7b_matches_its_parameter_count_and_kv_per_token() {
        let p = build("qwen2.5-7b", 1, 1.0, 0.0).unwrap();
        // Qwen2.5-7B: 7.61 billion parameters (untied embeddings), the QKV biases aside.
        assert!((7.5e9..7.7e9).contains(&(p.params_per_device as f64)), "{}", p.params_per_device);
        // 28 layers x (K + V) x 4 KV heads x 128 x 2 bytes: under half of Qwen3-8B's.
        assert_eq!(p.kv_bytes_per_token, 57_344);
        assert!(build("qwen3-8b", 1, 1.0, 0.0).unwrap().kv_bytes_per_token > 2 * p.kv_bytes_per_token);
        assert_eq!(p.rollout.tags[1].1.len(), 56);
        // The preset's 60 GiB of KV (each of its 56 buffers rounded up to 2 MiB): about 1.12 million tokens.
        assert_eq!(p.kv_cache_bytes / p.kv_bytes_per_token, 1_124_352);
        // TP 4 splits the 4 KV heads one a rank.
        assert_eq!(build("qwen2.5-7b", 4, 1.0, 0.0).unwrap().kv_bytes_per_token, 14_336);
    }

    #[test]
    fn scale_keeps_counts() {
        let a = build("qwen3-8b", 2, 1.0, 0.0).unwrap();
        let b = build("qwen3-8b", 2, 0.001, 0.0).unwrap();
        assert_eq!(a.trainer.count(), b.trainer.count());
        assert!(b.trainer.bytes() < a.trainer.bytes() / 500);
        assert!(build("none", 1, 1.0, 0.0).unwrap().trainer.tags.is_empty());
        assert!(build("llama", 1, 1.0, 0.0).is_err());
    }
}
