//! What a process holds, read from `/proc` (Linux): the tests and load tools that watch the
//! binaries from outside share these.

/// Resident memory of process `pid` in KiB, from `/proc/<pid>/status` (zero if it is gone).
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Open file descriptors of process `pid` (zero if it is gone).
pub fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}
