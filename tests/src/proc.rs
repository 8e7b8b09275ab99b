//! What a process holds, read from `/proc` (Linux): the tests and load tools that watch the
//! binaries from outside share these.

/// Resident memory of process `pid` in KiB, from `/proc/<pid>/status` (zero if it is gone).
pub fn rss_kib(pid: u32) -> u64 {
    status_field(pid, "VmRSS:")
        .and_then(|v| v.trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Whether process `pid` may get transparent huge pages (`THP_enabled` in `/proc/<pid>/status`,
/// 0 after `prctl(PR_SET_THP_DISABLE)`); `None` if it is gone or the kernel does not say.
/// A resident-memory bound means something only without them: with them, RSS grows in 2 MiB
/// steps whatever the process holds (`iop_bins::limit_huge_pages`).
pub fn thp_enabled(pid: u32) -> Option<bool> {
    match status_field(pid, "THP_enabled:")?.as_str() {
        "0" => Some(false),
        "1" => Some(true),
        _ => None,
    }
}

fn status_field(pid: u32, name: &str) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| Some(l.strip_prefix(name)?.trim().to_owned()))
}

/// Open file descriptors of process `pid` (zero if it is gone).
pub fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}
