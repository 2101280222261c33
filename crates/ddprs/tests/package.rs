//! The crates as a user outside this repository gets them: `cargo package` of the published
//! crates, the `.crate` files unpacked, `ddprun` installed from its package (`cargo install`),
//! and the two quick starts (`examples/quickstart-{candle,burn}.rs`) built as a downstream
//! crate outside the workspace whose only ddp-rs dependency is `ddprs` from those packages
//! (`[patch.crates-io]` pointing at the unpacked files), then run under `ddprun
//! --nproc-per-node 2`. Also: the quick starts' DDP-specific lines, counted against their
//! no-DDP twins, and the README showing them as they are.
//!
//! The downstream build works offline (`--offline`): every dependency it needs is one the
//! workspace's own build already downloaded, pinned by a copy of the workspace's `Cargo.lock`.
//! It builds in `target/tmp/downstream` (kept between runs: a later run rebuilds only what
//! changed), with its own target directory, so it never waits on the build lock of the
//! `cargo test` that runs it.

mod common;

use common::{workspace_root, PUBLISHED};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const QUICK_STARTS: [(&str, &str); 2] = [("candle", "candle"), ("burn", "burn")];
/// The issue's bound on the lines a program changes to become data-parallel.
const MAX_DDP_LINES: usize = 10;

fn example(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The code lines of a program: no blank lines, no comment-only lines, trailing `//` comments
/// and indentation removed.
fn code_lines(src: &str) -> Vec<String> {
    src.lines()
        .map(|l| match l.find(" // ") {
            Some(i) => &l[..i],
            None => l,
        })
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("//"))
        .map(String::from)
        .collect()
}

/// The lines of `new` that are not in a longest common subsequence with `old`: those a diff
/// shows as added or changed.
fn changed_lines(old: &[String], new: &[String]) -> Vec<String> {
    let (n, m) = (old.len(), new.len());
    let mut lcs = vec![vec![0usize; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[i][j] = if old[i] == new[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while j < m {
        if i < n && old[i] == new[j] {
            (i, j) = (i + 1, j + 1);
        } else if i < n && lcs[i + 1][j] >= lcs[i][j + 1] {
            i += 1;
        } else {
            out.push(new[j].clone());
            j += 1;
        }
    }
    out
}

fn ddp_lines(framework: &str) -> (Vec<String>, String) {
    let ddp = example(&format!("quickstart-{framework}.rs"));
    let plain = example(&format!("quickstart-{framework}-no-ddp.rs"));
    (changed_lines(&code_lines(&plain), &code_lines(&ddp)), ddp)
}

#[test]
fn the_quick_starts_take_at_most_ten_ddp_lines_each_all_marked() {
    for (framework, _) in QUICK_STARTS {
        let (changed, src) = ddp_lines(framework);
        assert!(
            !changed.is_empty() && changed.len() <= MAX_DDP_LINES,
            "quickstart-{framework}: {} DDP-specific lines (at most {MAX_DDP_LINES}):\n{}",
            changed.len(),
            changed.join("\n")
        );
        // Each of them says so (the programs' docs promise it), and only they do.
        let marked: Vec<&str> = src
            .lines()
            .filter(|l| l.contains(" // DDP") && !l.starts_with("//"))
            .collect();
        assert_eq!(
            marked.len(),
            changed.len(),
            "quickstart-{framework}: `// DDP` marks {marked:#?}"
        );
        for line in &changed {
            assert!(
                marked.iter().any(|m| m.contains(line.as_str())),
                "unmarked: {line}"
            );
        }
        for must in ["save_checkpoint", "verify_replicas", "init_process_group"] {
            assert!(
                changed.iter().any(|l| l.contains(must)),
                "quickstart-{framework}: no {must}"
            );
        }
    }
}

#[test]
fn the_line_count_sees_an_added_line_and_a_changed_one() {
    let old = code_lines("fn main() {\n    let a = 1; // one\n\n    // c\n    f(a);\n}\n");
    let new = code_lines("fn main() {\n    let pg = g();\n    let a = 1;\n    f2(a); // DDP\n}\n");
    assert_eq!(changed_lines(&old, &new), vec!["let pg = g();", "f2(a);"]);
}

/// The README's examples are the quick starts, verbatim.
#[test]
fn the_readme_shows_the_quick_starts_as_they_are() {
    let readme = std::fs::read_to_string(workspace_root().join("README.md")).unwrap();
    for (framework, _) in QUICK_STARTS {
        let src = example(&format!("quickstart-{framework}.rs"));
        let block = format!("```rust,no_run\n{src}```\n");
        assert!(
            readme.contains(&block),
            "README.md lacks quickstart-{framework}.rs as it is"
        );
    }
}

fn cargo(dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO"));
    c.current_dir(dir)
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("RUSTFLAGS");
    c
}

fn run_ok(c: &mut Command, what: &str) -> String {
    let out = c.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{text}",
        out.status
    );
    text
}

fn unpack(crate_file: &Path, into: &Path) {
    let gz = flate2::read::GzDecoder::new(std::fs::File::open(crate_file).unwrap());
    tar::Archive::new(gz).unpack(into).unwrap();
}

/// `ddprun --nproc-per-node 2 <bin>` in `cwd`, killed after `limit`.
fn ddprun(ddprun: &Path, bin: &Path, cwd: &Path, limit: Duration) -> (bool, String) {
    let log = cwd.join("output.log");
    let mut child = Command::new(ddprun)
        .args(["--nproc-per-node", "2"])
        .arg(bin)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::create(cwd.join("stderr.log")).unwrap())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > limit {
            child.kill().ok();
            child.wait().ok();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let text = std::fs::read_to_string(&log).unwrap()
        + &std::fs::read_to_string(cwd.join("stderr.log")).unwrap();
    (status.is_some_and(|s| s.success()), text)
}

/// The mean training loss each rank printed for its last epoch.
fn last_losses(output: &str) -> Vec<f64> {
    (0..2)
        .map(|rank| {
            let prefix = format!("[rank{rank}]: epoch 4: mean loss ");
            let line = output.lines().find_map(|l| l.strip_prefix(prefix.as_str()));
            line.unwrap_or_else(|| panic!("no {prefix:?} in:\n{output}"))
                .trim()
                .parse()
                .unwrap()
        })
        .collect()
}

#[test]
fn the_quick_starts_build_from_the_packages_outside_the_workspace_and_train_under_ddprun() {
    let root = workspace_root();
    let work = Path::new(env!("CARGO_TARGET_TMPDIR")).join("downstream");
    let target = work.join("target");
    std::fs::create_dir_all(&work).unwrap();

    // 1. The packages, as `cargo publish` would upload them.
    let mut package = cargo(&root);
    package.args([
        "package",
        "--no-verify",
        "--offline",
        "--allow-dirty",
        "--target-dir",
    ]);
    package.arg(work.join("package-target"));
    for name in PUBLISHED {
        package.args(["-p", name]);
    }
    run_ok(&mut package, "cargo package");
    let unpacked = work.join("crates");
    let _ = std::fs::remove_dir_all(&unpacked);
    std::fs::create_dir_all(&unpacked).unwrap();
    let version = env!("CARGO_PKG_VERSION");
    let mut patch = String::from("[patch.crates-io]\n");
    for name in PUBLISHED {
        let file = work.join(format!("package-target/package/{name}-{version}.crate"));
        unpack(&file, &unpacked);
        let dir = unpacked.join(format!("{name}-{version}"));
        for f in ["LICENSE-MIT", "LICENSE-APACHE", "README.md", "Cargo.toml"] {
            let path = dir.join(f);
            assert!(path.is_file(), "the package {name} lacks {f}");
            assert!(!path.is_symlink(), "{name}'s {f} is a link in the package");
        }
        if name != "ddprun" {
            // (ddprun is installed below; no quick start uses the launcher library.)
            patch += &format!("{name} = {{ path = {:?} }}\n", dir.to_str().unwrap());
        }
    }

    // 2. The launcher, as `cargo install ddprun` installs it (its one dependency of ours from
    //    the packages too).
    let bin_root = work.join("bin");
    let comm = unpacked.join(format!("ddp-comm-{version}"));
    run_ok(
        cargo(&work)
            .args(["install", "--debug", "--force", "--offline", "--root"])
            .arg(&bin_root)
            .arg("--target-dir")
            .arg(&target)
            .arg("--path")
            .arg(unpacked.join(format!("ddprun-{version}")))
            .arg("--config")
            .arg(format!(
                "patch.crates-io.ddp-comm.path={:?}",
                comm.to_str().unwrap()
            )),
        "cargo install ddprun",
    );
    let ddprun_bin = bin_root.join("bin/ddprun");

    // 3. A downstream workspace, one crate per framework, each depending on `ddprs` with that
    //    framework's feature and on the framework itself, nothing else of ours.
    let ws = work.join("quickstart");
    let lock = std::fs::read_to_string(root.join("Cargo.lock")).unwrap();
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("Cargo.lock"), lock).unwrap();
    std::fs::write(
        ws.join("Cargo.toml"),
        format!("[workspace]\nmembers = [\"candle\", \"burn\"]\nresolver = \"2\"\n\n{patch}"),
    )
    .unwrap();
    for (framework, feature) in QUICK_STARTS {
        let deps = match framework {
            "candle" => "candle-core = \"0.11\"\ncandle-nn = \"0.11\"\n",
            _ => "burn = { version = \"0.22.1\", default-features = false, features = [\"std\", \"autodiff\", \"optim\", \"dataset\", \"flex\"] }\n",
        };
        let dir = ws.join(framework);
        std::fs::create_dir_all(dir.join("src")).unwrap();
        std::fs::write(
            dir.join("Cargo.toml"),
            format!(
                "[package]\nname = \"quickstart-{framework}\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\
                 publish = false\n\n[dependencies]\nddprs = {{ version = \"{version}\", features = [\"{feature}\"] }}\n{deps}"
            ),
        )
        .unwrap();
        let main = example(&format!("quickstart-{framework}.rs"));
        if std::fs::read_to_string(dir.join("src/main.rs"))
            .ok()
            .as_deref()
            != Some(main.as_str())
        {
            std::fs::write(dir.join("src/main.rs"), main).unwrap();
        }
    }
    for (framework, _) in QUICK_STARTS {
        let out = run_ok(
            cargo(&ws)
                .args(["build", "--offline", "-p"])
                .arg(format!("quickstart-{framework}"))
                .arg("--target-dir")
                .arg(&target),
            &format!("cargo build of quickstart-{framework}"),
        );
        assert!(
            !out.contains("warning:"),
            "quickstart-{framework} builds with warnings:\n{out}"
        );
    }
    // The lock resolved ddp-rs to the unpacked packages, not to anything else.
    let lock = std::fs::read_to_string(ws.join("Cargo.lock")).unwrap();
    assert!(
        lock.contains("name = \"ddprs\""),
        "no ddprs in the downstream lock"
    );

    // 4. Each under the launcher: two ranks train, rank 0 saves, the replicas are identical.
    for (framework, _) in QUICK_STARTS {
        let run = tempfile::tempdir().unwrap();
        let bin = target.join(format!("debug/quickstart-{framework}"));
        let (ok, out) = ddprun(&ddprun_bin, &bin, run.path(), Duration::from_secs(300));
        assert!(ok, "quickstart-{framework} under ddprun failed:\n{out}");
        for loss in last_losses(&out) {
            // 4 classes: a uniform guess costs ln 4 = 1.386.
            assert!(
                loss < 0.5,
                "quickstart-{framework}: last-epoch loss {loss}:\n{out}"
            );
        }
        let ckpt = ddprs::checkpoint::load(&run.path().join("checkpoints"))
            .unwrap_or_else(|e| panic!("quickstart-{framework}: {e}\n{out}"))
            .unwrap_or_else(|| panic!("quickstart-{framework} saved no checkpoint:\n{out}"));
        assert_eq!(ckpt.meta.world_size, 2, "quickstart-{framework}");
        assert_eq!(ckpt.meta.epoch, 5, "quickstart-{framework}");
    }
}
