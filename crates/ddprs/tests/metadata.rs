//! What crates.io needs of every package this workspace publishes, read from `cargo metadata`
//! (the manifests as cargo resolves them, workspace inheritance included): a version on every
//! dependency on another of our crates (`cargo package` refuses a path-only one), the licence
//! texts, a `rust-version`, and the metadata of the crates.io page.

mod common;

use common::{workspace_root, PUBLISHED};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

fn metadata() -> Value {
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(workspace_root())
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn is_published(pkg: &Value) -> bool {
    // `publish = false` is `[]` in cargo metadata; `null` means any registry.
    pkg["publish"].as_array().is_none_or(|r| !r.is_empty())
}

/// Every problem of one package's manifest, as `name: what`.
fn problems(pkg: &Value, ours: &[&str], version: &str) -> Vec<String> {
    let name = pkg["name"].as_str().unwrap();
    let dir = Path::new(pkg["manifest_path"].as_str().unwrap())
        .parent()
        .unwrap()
        .to_path_buf();
    let mut out = Vec::new();
    let mut need = |what: &str, ok: bool| {
        if !ok {
            out.push(format!("{name}: {what}"));
        }
    };
    for field in [
        "description",
        "repository",
        "documentation",
        "homepage",
        "rust_version",
    ] {
        need(
            &format!("no `{field}`"),
            pkg[field].as_str().is_some_and(|s| !s.is_empty()),
        );
    }
    need(
        "licence is not `MIT OR Apache-2.0`",
        pkg["license"] == "MIT OR Apache-2.0",
    );
    let list = |f: &str| pkg[f].as_array().map_or(0, Vec::len);
    need("keywords: 1 to 5", (1..=5).contains(&list("keywords")));
    need("no categories", list("categories") > 0);
    let readme = pkg["readme"].as_str().map(|r| dir.join(r));
    need("no readme file", readme.is_some_and(|r| r.is_file()));
    let root = workspace_root();
    for licence in ["LICENSE-MIT", "LICENSE-APACHE"] {
        let same = std::fs::read(dir.join(licence)).ok() == std::fs::read(root.join(licence)).ok();
        need(
            &format!("no {licence} (the root's text) in the package directory"),
            same,
        );
    }
    for dep in pkg["dependencies"].as_array().unwrap() {
        let dep_name = dep["name"].as_str().unwrap();
        if !ours.contains(&dep_name) && dep["path"].is_null() {
            continue;
        }
        let req = dep["req"].as_str().unwrap();
        need(
            &format!("dependency `{dep_name}` has requirement `{req}`, not `^{version}`"),
            req == format!("^{version}"),
        );
        need(
            &format!("depends on `{dep_name}`, which is not published"),
            ours.contains(&dep_name),
        );
    }
    out
}

#[test]
fn every_published_crate_has_versioned_internal_deps_licences_and_rust_version() {
    let meta = metadata();
    let packages = meta["packages"].as_array().unwrap();
    let published: Vec<&str> = packages
        .iter()
        .filter(|p| is_published(p))
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    let mut want = PUBLISHED.to_vec();
    want.sort_unstable();
    let mut got = published.clone();
    got.sort_unstable();
    assert_eq!(
        got, want,
        "the published crates (the rest must say `publish = false`)"
    );
    let version = env!("CARGO_PKG_VERSION");
    let all: Vec<String> = packages
        .iter()
        .filter(|p| is_published(p))
        .flat_map(|p| problems(p, &PUBLISHED, version))
        .collect();
    assert!(
        all.is_empty(),
        "manifests not ready for crates.io:\n{}",
        all.join("\n")
    );
}

/// The checker finds what it is for: a manifest without a version on an internal dependency,
/// without licence files and without `rust-version` (a package written here, outside the
/// workspace, read by cargo like the real ones).
#[test]
fn the_checker_names_a_missing_version_licence_and_rust_version() {
    let dir = tempfile::tempdir().unwrap();
    let core = workspace_root().join("crates/ddp-core");
    std::fs::create_dir(dir.path().join("src")).unwrap();
    std::fs::write(dir.path().join("src/lib.rs"), "").unwrap();
    std::fs::write(dir.path().join("README.md"), "x").unwrap();
    std::fs::write(
        dir.path().join("Cargo.toml"),
        format!(
            "[package]\nname = \"ddp-bad\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\
             license = \"MIT OR Apache-2.0\"\ndescription = \"d\"\nrepository = \"r\"\n\
             documentation = \"d\"\nhomepage = \"h\"\nreadme = \"README.md\"\nkeywords = [\"k\"]\n\
             categories = [\"science\"]\n[dependencies]\nddp-core = {{ path = {core:?} }}\n\
             [workspace]\n"
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).unwrap();
    let found = problems(&meta["packages"][0], &PUBLISHED, "0.1.0").join("\n");
    for what in [
        "no `rust_version`",
        "no LICENSE-MIT",
        "no LICENSE-APACHE",
        "`ddp-core` has requirement `*`",
    ] {
        assert!(found.contains(what), "{what:?} not reported in:\n{found}");
    }
}
