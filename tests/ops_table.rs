//! docs/ops.md lists every public op: each `pub fn` of an `impl Tensor` block, each public
//! `nn` type and each loss, found by reading the sources.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files
}

/// The name of a `pub fn` or `pub struct` declared at `indent` on `line`.
fn declared(line: &str, indent: &str, keyword: &str) -> Option<String> {
    let rest = line.strip_prefix(indent)?.strip_prefix(keyword)?;
    let name: String = rest
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty()).then_some(name)
}

/// Public names the table must list, with where each was found.
fn public_ops(root: &Path) -> Vec<(String, String)> {
    let mut names = Vec::new();
    for file in rust_files(&root.join("src")) {
        let text = std::fs::read_to_string(&file).unwrap();
        let shown = file.strip_prefix(root).unwrap().display().to_string();
        let in_nn = shown.starts_with("src/nn");
        let mut in_tensor_impl = false;
        for line in text.lines() {
            if line.starts_with("impl Tensor {") {
                in_tensor_impl = true;
            } else if line.starts_with('}') {
                in_tensor_impl = false;
            }
            if in_tensor_impl {
                if let Some(name) = declared(line, "    ", "pub fn ") {
                    names.push((name, shown.clone()));
                }
            }
            if in_nn {
                for keyword in ["pub struct ", "pub fn "] {
                    if let Some(name) = declared(line, "", keyword) {
                        names.push((name, shown.clone()));
                    }
                }
            }
        }
    }
    names
}

#[test]
fn the_op_table_lists_every_public_op() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let table = std::fs::read_to_string(root.join("docs/ops.md")).unwrap();
    let ops = public_ops(root);
    assert!(ops.len() > 100, "found only {} public ops", ops.len());
    let missing: Vec<String> = ops
        .iter()
        .filter(|(name, _)| {
            !(table.contains(&format!("`{name}`"))
                || table.contains(&format!("`Tensor::{name}`"))
                || table.contains(&format!("`nn::{name}`")))
        })
        .map(|(name, file)| format!("{name} ({file})"))
        .collect();
    assert!(missing.is_empty(), "docs/ops.md lacks: {missing:?}");
}
