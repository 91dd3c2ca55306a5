//! The C ABI as callers see it: include/tms.h against the library's exports, its structs and
//! codes, and the ctypes mirror of python/tms, against tms_proto::abi (where the hook's are
//! declared), and the torch_memory_saver symbol set bound from Python exactly as its wrapper
//! binds it.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use tms_e2e::*;
use tms_proto::abi::{self, Layout};

/// Function names declared in tms.h.
fn header_functions() -> BTreeSet<String> {
    let ws = workspace();
    let text = std::fs::read_to_string(ws.root.join("include/tms.h")).unwrap();
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || line.starts_with("/*") || line.starts_with('*') || !line.ends_with(");") {
            continue;
        }
        let Some(open) = line.find('(') else { continue };
        let name = line[..open].split(|c: char| !(c.is_alphanumeric() || c == '_')).rfind(|s| !s.is_empty());
        if let Some(n) = name {
            names.insert(n.to_string());
        }
    }
    names
}

#[test]
fn header_declares_exactly_the_exports() {
    let ws = workspace();
    let out = Command::new("nm").args(["-D", "--defined-only"]).arg(ws.hook()).output().expect("nm");
    let exports: BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2).map(String::from))
        .collect();
    let interposed: BTreeSet<String> = [
        "cudaMalloc",
        "cudaFree",
        "cudaHostGetFlags",
        "cudaGetLastError",
        "aclrtMalloc",
        "aclrtMallocAlign32",
        "aclrtFree",
        "dlsym",
        "ncclCommInitRank",
        "ncclCommInitRankConfig",
        "ncclCommInitRankScalable",
        "ncclCommInitAll",
        "ncclCommSplit",
        "ncclCommShrink",
        "ncclCommDestroy",
        "ncclCommAbort",
        "ncclCommRegister",
        "ncclCommDeregister",
        "HcclCommInitRootInfo",
        "HcclCommInitRootInfoConfig",
        "HcclCommInitClusterInfo",
        "HcclCommInitAll",
        "HcclCommDestroy",
        "cudaIpcGetMemHandle",
        "aclrtIpcMemGetExportKey",
        "ncclCommWindowRegister",
    ]
    .map(String::from)
    .into();
    let declared = header_functions();
    let api: BTreeSet<String> = exports.difference(&interposed).cloned().collect();
    assert_eq!(declared, api, "include/tms.h and the exports of libtms_hook.so differ");
    assert!(interposed.is_subset(&exports), "missing interposed entry points");
}

#[test]
fn header_compiles_as_c99_and_cxx() {
    let ws = workspace();
    let src = ws.c_out.join("header_check.c");
    std::fs::write(
        &src,
        "#include \"tms.h\"\nint main(void) { tms_report r; tms_tag_status s; (void)r; (void)s; return 0; }\n",
    )
    .unwrap();
    for (compiler, std) in [("cc", "-std=c99"), ("c++", "-std=c++11")] {
        if Command::new(compiler).arg("--version").output().is_err() {
            continue;
        }
        let out = Command::new(compiler)
            .args([std, "-Wall", "-Wextra", "-Werror", "-fsyntax-only", "-x"])
            .arg(if compiler == "cc" { "c" } else { "c++" })
            .arg(format!("-I{}", ws.root.join("include").display()))
            .arg(&src)
            .output()
            .unwrap();
        assert_ok(&out, &format!("{compiler} {std} tms.h"));
    }
}

#[test]
fn torch_memory_saver_bindings_work_from_python_ctypes() {
    let ws = workspace();
    let node = SimNode::new("1GiB");
    let script = ws.root.join("tests/python/tms_ctypes_check.py");
    let out = run_ok(
        node.hooked(&["python3".into(), script])
            .env("PYTHONPATH", ws.root.join("python"))
            .env("PYTHONDONTWRITEBYTECODE", "1"),
    );
    assert!(out.contains("ctypes ok"), "{out}");
}

/// One field as the header (compiled) or the ctypes mirror lays it out. `types` holds every
/// name of its type: ctypes spells `c_uint64` as `c_ulong` too.
#[derive(Debug)]
struct SeenField {
    name: String,
    types: Vec<String>,
    offset: usize,
    size: usize,
}

/// A struct as the header or the mirror has it.
#[derive(Debug)]
struct SeenStruct {
    size: usize,
    fields: Vec<SeenField>,
}

/// What differs between `layout` and `seen` (`where_` names the side), one line a field: a field
/// on one side only, or another type, offset or size. `ty` picks the spelling of that side.
fn differences(where_: &str, layout: &Layout, seen: Option<&SeenStruct>, ty: fn(&abi::Field) -> &str) -> Vec<String> {
    let name = layout.c_name;
    let Some(seen) = seen else { return vec![format!("{where_}: no struct {name}")] };
    let mut out = Vec::new();
    for f in layout.fields {
        match seen.fields.iter().find(|s| s.name == f.name) {
            None => out.push(format!("{where_}: {name}.{} is missing", f.name)),
            Some(s) => {
                if !s.types.iter().any(|t| t == ty(f)) {
                    out.push(format!("{where_}: {name}.{} is {}, not {}", f.name, s.types.join("/"), ty(f)));
                }
                if (s.offset, s.size) != (f.offset, f.size) {
                    out.push(format!(
                        "{where_}: {name}.{} at offset {} ({} bytes), not {} ({} bytes)",
                        f.name, s.offset, s.size, f.offset, f.size
                    ));
                }
            }
        }
    }
    for s in seen.fields.iter().filter(|s| !layout.fields.iter().any(|f| f.name == s.name)) {
        out.push(format!("{where_}: {name}.{} is not in tms_proto::abi::{}", s.name, layout.name));
    }
    if seen.size != layout.size {
        out.push(format!("{where_}: sizeof({name}) is {}, not {}", seen.size, layout.size));
    }
    out
}

/// Removes `/* ... */` comments (the header's run over several lines).
fn without_comments(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(open) = rest.find("/*") {
        out.push_str(&rest[..open]);
        rest = rest[open..].find("*/").map_or("", |close| &rest[open + close + 2..]);
    }
    out + rest
}

/// The `typedef struct NAME { ... } NAME;` of include/tms.h: each field's type and name, in order.
fn header_struct_fields(text: &str) -> BTreeMap<String, Vec<(String, String)>> {
    let text = without_comments(text);
    let mut out = BTreeMap::new();
    for part in text.split("typedef struct ").skip(1) {
        let (Some(open), Some(close)) = (part.find('{'), part.find('}')) else { continue };
        let name = part[..open].trim().to_string();
        let fields = part[open + 1..close]
            .split(';')
            .map(|d| d.split_whitespace().collect::<Vec<_>>().join(" "))
            .filter(|d| !d.is_empty())
            .map(|d| {
                let at = d.rfind(|c: char| !(c.is_alphanumeric() || c == '_')).map_or(0, |i| i + 1);
                (d[..at].trim().to_string(), d[at..].to_string())
            })
            .collect();
        out.insert(name, fields);
    }
    out
}

/// The header's structs as a C compiler lays them out: a program prints sizeof and every field's
/// offsetof and size.
fn header_structs() -> BTreeMap<String, SeenStruct> {
    let ws = workspace();
    let declared = header_struct_fields(&std::fs::read_to_string(ws.root.join("include/tms.h")).unwrap());
    let mut src = String::from("#include <stdio.h>\n#include <stddef.h>\n#include \"tms.h\"\nint main(void) {\n");
    for (name, fields) in &declared {
        src += &format!("  printf(\"%zu\\n\", sizeof({name}));\n");
        for (_, f) in fields {
            src += &format!("  printf(\"%zu %zu\\n\", offsetof({name}, {f}), sizeof((({name} *)0)->{f}));\n");
        }
    }
    src += "  return 0;\n}\n";
    let path = ws.c_out.join("header_layout.c");
    std::fs::write(&path, src).unwrap();
    let printed = run_ok(&mut Command::new(compile("header_layout", &[path], &[])));
    let mut numbers = printed.split_whitespace().map(|n| n.parse::<usize>().unwrap());
    let mut next = || numbers.next().expect("one number per sizeof and offsetof");
    declared
        .into_iter()
        .map(|(name, fields)| {
            let size = next();
            let fields = fields
                .into_iter()
                .map(|(ty, name)| SeenField { name, types: vec![ty], offset: next(), size: next() })
                .collect();
            (name, SeenStruct { size, fields })
        })
        .collect()
}

/// `#define TMS_OK 0` and the like in include/tms.h.
fn header_codes() -> BTreeMap<String, i32> {
    let text = std::fs::read_to_string(workspace().root.join("include/tms.h")).unwrap();
    text.lines()
        .filter_map(|l| {
            let mut words = l.strip_prefix("#define TMS_")?.split_whitespace();
            Some((format!("TMS_{}", words.next()?), words.next()?.parse().ok()?))
        })
        .collect()
}

/// python/tms's ctypes mirror (tms._lib): each struct named as in Rust, and the `TMS_*` codes.
fn python_mirror() -> (BTreeMap<String, SeenStruct>, BTreeMap<String, i32>) {
    let ws = workspace();
    let script = r#"
import ctypes, json, sys
from tms import _lib
def names(t):
    return sorted(n for n in dir(ctypes) if n.startswith("c_") and getattr(ctypes, n) is t)
structs = {}
for name in sys.argv[1:]:
    cls = getattr(_lib, name, None)
    if cls is not None:
        fields = [[f, names(t), getattr(cls, f).offset, getattr(cls, f).size] for f, t in cls._fields_]
        structs[name] = {"size": ctypes.sizeof(cls), "fields": fields}
codes = {n: v for n, v in vars(_lib).items() if n.startswith("TMS_") and isinstance(v, int)}
print(json.dumps({"structs": structs, "codes": codes}))
"#;
    let out = run_ok(
        Command::new("python3")
            .args(["-c", script])
            .args(abi::LAYOUTS.iter().map(|l| l.name))
            .env("PYTHONPATH", ws.root.join("python"))
            .env("PYTHONDONTWRITEBYTECODE", "1"),
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let n = |v: &serde_json::Value| v.as_u64().unwrap() as usize;
    let structs = v["structs"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, s)| {
            let fields = s["fields"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| SeenField {
                    name: f[0].as_str().unwrap().to_string(),
                    types: f[1].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect(),
                    offset: n(&f[2]),
                    size: n(&f[3]),
                })
                .collect();
            (name.clone(), SeenStruct { size: n(&s["size"]), fields })
        })
        .collect();
    let codes = v["codes"].as_object().unwrap().iter().map(|(k, c)| (k.clone(), c.as_i64().unwrap() as i32)).collect();
    (structs, codes)
}

#[test]
fn header_and_python_mirror_lay_out_the_structs_and_codes_of_tms_proto() {
    let header = header_structs();
    let (python, python_codes) = python_mirror();
    let mut wrong = Vec::new();
    for layout in abi::LAYOUTS {
        wrong.extend(differences("include/tms.h", &layout, header.get(layout.c_name), |f| f.c_type));
        wrong.extend(differences("python/tms/_lib.py", &layout, python.get(layout.name), |f| f.ctypes));
    }
    let structs: BTreeSet<&str> = abi::LAYOUTS.iter().map(|l| l.c_name).collect();
    for extra in header.keys().filter(|h| !structs.contains(h.as_str())) {
        wrong.push(format!("include/tms.h: struct {extra} is not in tms_proto::abi"));
    }
    let codes: BTreeMap<String, i32> = abi::CODES.iter().map(|&(n, c)| (n.to_string(), c)).collect();
    for (side, seen) in [("include/tms.h", header_codes()), ("python/tms/_lib.py", python_codes)] {
        for (name, code) in &codes {
            match seen.get(name) {
                Some(c) if c == code => {}
                Some(c) => wrong.push(format!("{side}: {name} is {c}, not {code}")),
                None => wrong.push(format!("{side}: {name} is missing")),
            }
        }
        for name in seen.keys().filter(|n| !codes.contains_key(*n)) {
            wrong.push(format!("{side}: {name} is not in tms_proto::abi::CODES"));
        }
    }
    assert!(wrong.is_empty(), "the C ABI differs from tms_proto::abi:\n{}", wrong.join("\n"));
}

#[test]
fn the_header_parser_sees_every_field_and_type() {
    // The checks above are only as good as this parse: a multi-line comment, a pointer field.
    let fields = header_struct_fields(
        "typedef struct s {\n  const char *tag; /* a\n  b; */\n  uint64_t n;  /* c */\n} s;\n#define TMS_OK 0\n",
    );
    let want = vec![("const char *".to_string(), "tag".to_string()), ("uint64_t".into(), "n".into())];
    assert_eq!(fields.get("s"), Some(&want));
}
