//! The C ABI as callers see it: include/tms.h against the library's exports, and the
//! torch_memory_saver symbol set bound from Python exactly as its wrapper binds it.

use std::collections::BTreeSet;
use std::process::Command;
use tms_e2e::*;

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
    let out = run_ok(node.hooked(&["python3".into(), script]).env("PYTHONDONTWRITEBYTECODE", "1"));
    assert!(out.contains("ctypes ok"), "{out}");
}
