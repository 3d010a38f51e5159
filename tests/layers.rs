//! The layers only look down: `device <- tensor <- kernel <- ops <- autograd <- nn, optim <- io,
//! capture <- dist, models`. Every `crate::` path in a folder names only its own folder or one below it.

use std::path::Path;

/// Layer rank of each top-level module of `src/`; a module may name only lower ranks and itself.
const LAYERS: &[(&str, u32)] = &[
    ("error", 0),
    ("seed", 0),
    ("device", 1),
    ("tensor", 2),
    ("kernel", 3),
    ("ops", 4),
    ("autograd", 5),
    ("nn", 6),
    ("optim", 6),
    ("io", 7),
    ("capture", 7),
    ("dist", 8),
    ("models", 8),
];

/// Root re-exports (`crate::no_grad`) and macros, by the module they come from.
const ROOT_ALIASES: &[(&str, &str)] = &[
    ("no_grad", "autograd"),
    ("manual_seed", "seed"),
    ("kernel_params", "kernel"),
    ("Error", "error"),
    ("Result", "error"),
    ("Tensor", "tensor"),
    ("Device", "device"),
];

/// The top-level module a `crate::NAME` path lands in.
fn module_of(name: &str) -> &str {
    ROOT_ALIASES
        .iter()
        .find(|(alias, _)| *alias == name)
        .map_or(name, |(_, m)| m)
}

fn rank(module: &str) -> Option<u32> {
    LAYERS.iter().find(|(m, _)| *m == module).map(|(_, r)| *r)
}

/// Every `crate::NAME` in `text`.
fn crate_paths(text: &str) -> Vec<&str> {
    text.match_indices("crate::")
        .map(|(at, m)| {
            let rest = &text[at + m.len()..];
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            &rest[..end]
        })
        .filter(|name| !name.is_empty())
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_module_names_a_layer_above_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut violations = Vec::new();
    for file in files {
        let relative = file.strip_prefix(&src).unwrap();
        let top = relative
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        let Some(own) = rank(&top) else {
            continue; // lib.rs and test-only modules sit above every layer
        };
        let text = std::fs::read_to_string(&file).unwrap();
        for name in crate_paths(&text) {
            let module = module_of(name);
            let allowed = module == top || rank(module).is_some_and(|r| r < own);
            if !allowed {
                violations.push(format!("{} names crate::{name}", relative.display()));
            }
        }
    }
    assert!(violations.is_empty(), "{}", violations.join("\n"));
}
