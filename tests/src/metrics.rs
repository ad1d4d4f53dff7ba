//! Prometheus text exposition, parsed into samples, and label-filtered sums.

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// One sample line: `name{labels} value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The metric name (with `_bucket`/`_sum`/`_count` suffixes as printed).
    pub name: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its value.
    pub value: f64,
}

/// Every sample of one scrape.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    /// The samples, in the order printed.
    pub samples: Vec<Sample>,
}

fn parse_labels(s: &str) -> Option<BTreeMap<String, String>> {
    let mut labels = BTreeMap::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| *c == ',' || c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            return Some(labels);
        }
        let mut key = String::new();
        for c in chars.by_ref() {
            if c == '=' {
                break;
            }
            key.push(c);
        }
        if chars.next() != Some('"') {
            return None;
        }
        let mut value = String::new();
        loop {
            match chars.next()? {
                '"' => break,
                '\\' => match chars.next()? {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                c => value.push(c),
            }
        }
        labels.insert(key.trim().to_owned(), value);
    }
}

fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (series, value) = match line.find('{') {
        Some(open) => {
            let close = line.rfind('}')?;
            let labels = parse_labels(&line[open + 1..close])?;
            let value = line[close + 1..].split_whitespace().next()?;
            ((line[..open].to_owned(), labels), value)
        }
        None => {
            let mut parts = line.split_whitespace();
            let name = parts.next()?;
            ((name.to_owned(), BTreeMap::new()), parts.next()?)
        }
    };
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name: series.0,
        labels: series.1,
        value,
    })
}

impl Metrics {
    /// Parses a text exposition; lines that do not parse are skipped.
    pub fn parse(text: &str) -> Self {
        Self {
            samples: text.lines().filter_map(parse_line).collect(),
        }
    }

    /// Samples of `name` whose labels include every `(key, value)` of `filter`.
    pub fn matching<'a>(
        &'a self,
        name: &'a str,
        filter: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| {
            s.name == name
                && filter
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).is_some_and(|l| l == v))
        })
    }

    /// Sum of the samples of `name` matching `filter` (0 when none).
    pub fn sum(&self, name: &str, filter: &[(&str, &str)]) -> f64 {
        self.matching(name, filter).map(|s| s.value).sum()
    }

    /// Sum of the samples of `name` whose label `key` is not `value`.
    pub fn sum_except(&self, name: &str, key: &str, value: &str) -> f64 {
        self.samples
            .iter()
            .filter(|s| s.name == name && s.labels.get(key).is_none_or(|l| l != value))
            .map(|s| s.value)
            .sum()
    }

    /// The samples of `name`, one per line, for assertion messages.
    pub fn show(&self, name: &str) -> String {
        let mut out = String::new();
        for s in self.matching(name, &[]) {
            let _ = writeln!(out, "{name}{:?} {}", s.labels, s.value);
        }
        if out.is_empty() {
            out.push_str(name);
            out.push_str(": no samples\n");
        }
        out
    }
}

/// Scrapes `<base>/metrics` (`base` = `http://host:port`).
pub async fn scrape(client: &reqwest::Client, base: &str) -> Metrics {
    let url = format!("{base}/metrics");
    let resp = client
        .get(&url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    assert!(resp.status().is_success(), "GET {url}: {}", resp.status());
    Metrics::parse(&resp.text().await.unwrap_or_default())
}

/// [`scrape`] within `timeout`; `None` when the server does not answer (stopped, gone).
pub async fn try_scrape(
    client: &reqwest::Client,
    base: &str,
    timeout: std::time::Duration,
) -> Option<Metrics> {
    let get = async {
        let resp = client.get(format!("{base}/metrics")).send().await.ok()?;
        let text = resp.error_for_status().ok()?.text().await.ok()?;
        Some(Metrics::parse(&text))
    };
    tokio::time::timeout(timeout, get).await.ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_labels_values_and_sums() {
        let m = Metrics::parse(
            "# HELP x y\n# TYPE a counter\na{api=\"chat\",outcome=\"ok\"} 3\n\
             a{api=\"completions\",outcome=\"ok\"} 2\na{api=\"chat\",outcome=\"aborted\"} 1\n\
             b 7.5\nc{l=\"q\\\"uote,x\"} 1e3\nh_bucket{le=\"+Inf\"} 4\n",
        );
        assert_eq!(m.sum("a", &[]), 6.0);
        assert_eq!(m.sum("a", &[("outcome", "ok")]), 5.0);
        assert_eq!(m.sum("a", &[("api", "chat"), ("outcome", "ok")]), 3.0);
        assert_eq!(m.sum_except("a", "outcome", "ok"), 1.0);
        assert_eq!(m.sum("b", &[]), 7.5);
        assert_eq!(m.sum("c", &[("l", "q\"uote,x")]), 1000.0);
        assert_eq!(m.sum("h_bucket", &[("le", "+Inf")]), 4.0);
        assert_eq!(m.sum("missing", &[]), 0.0);
    }
}
