//! Nova's microversions: what the service asks for (`--nova-microversion`),
//! what a cloud supports (its version document), and where that document
//! is.

/// The microversion the service asks for: an exact `2.N`, or `latest`,
/// which start-up resolves to the cloud's maximum (Nova's own `latest`
/// would change under the service at the cloud's next upgrade).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Microversion {
    Latest,
    Exact(u32, u32),
}

impl Microversion {
    /// What the service speaks unless told otherwise: 2.89 lists the
    /// Cinder attachment and BDM ids and still answers an attach with 200.
    pub const DEFAULT: Self = Self::Exact(2, 89);
}

impl std::str::FromStr for Microversion {
    type Err = String;

    /// `latest` or `2.N` (Nova's compute API microversions, N from 1).
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "latest" {
            return Ok(Self::Latest);
        }
        let number = |p: &str| {
            (!p.is_empty() && p.len() <= 4 && p.bytes().all(|b| b.is_ascii_digit()))
                .then(|| p.parse::<u32>().ok())
                .flatten()
        };
        match s.split_once('.').map(|(a, b)| (number(a), number(b))) {
            Some((Some(2), Some(minor))) if minor >= 1 => Ok(Self::Exact(2, minor)),
            _ => Err(format!(
                "{s:?} is not a Nova microversion: write 2.N (like 2.89) or latest"
            )),
        }
    }
}

impl std::fmt::Display for Microversion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Latest => f.write_str("latest"),
            Self::Exact(major, minor) => write!(f, "{major}.{minor}"),
        }
    }
}

/// The microversions a Nova supports, from its version document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VersionRange {
    pub min: (u32, u32),
    pub max: (u32, u32),
}

impl VersionRange {
    /// The version to speak when `wanted` is asked for: `latest` is the
    /// maximum; an exact version must lie in the range.
    pub fn choose(&self, wanted: Microversion) -> Result<(u32, u32), String> {
        match wanted {
            Microversion::Latest => Ok(self.max),
            Microversion::Exact(major, minor)
                if (major, minor) < self.min || (major, minor) > self.max =>
            {
                Err(format!(
                    "microversion {wanted} is outside what this Nova supports ({} to {})",
                    show(self.min),
                    show(self.max)
                ))
            }
            Microversion::Exact(major, minor) => Ok((major, minor)),
        }
    }
}

impl std::fmt::Display for VersionRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} to {}", show(self.min), show(self.max))
    }
}

fn show((major, minor): (u32, u32)) -> String {
    format!("{major}.{minor}")
}

/// Where Nova's version document is: the compute endpoint's root, the
/// URL up to its version segment (`http://h:8774/v2.1/<project>` →
/// `http://h:8774/`, `https://cloud/compute/v2.1` → `https://cloud/compute/`).
pub(super) fn version_root(compute: &str) -> String {
    // Not a URL: the request to it fails and says so, naming it.
    let Ok(mut url) = reqwest::Url::parse(compute) else {
        return compute.to_string();
    };
    let is_version = |seg: &str| {
        seg.strip_prefix('v').is_some_and(|v| {
            !v.is_empty()
                && v.split('.')
                    .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        })
    };
    // No segments only for URLs that cannot be a base (not http).
    let segments: Vec<String> = url
        .path_segments()
        .map(|s| s.map(str::to_string).collect())
        .unwrap_or_default();
    let keep = segments
        .iter()
        .position(|s| is_version(s))
        .unwrap_or(segments.len());
    let mut path = segments[..keep]
        .iter()
        .filter(|s| !s.is_empty())
        .map(|s| format!("/{s}"))
        .collect::<String>();
    path.push('/');
    url.set_path(&path);
    url.set_query(None);
    url.to_string()
}

#[derive(serde::Deserialize)]
struct VersionsDoc {
    #[serde(default)]
    versions: Vec<VersionEntry>,
    version: Option<VersionEntry>,
}

#[derive(serde::Deserialize)]
struct VersionEntry {
    id: String,
    #[serde(default)]
    version: String,
    #[serde(default)]
    min_version: String,
}

/// The v2.1 API's range from a version document: the root's list
/// (`{"versions": [...]}`) or one version (`{"version": {...}}`). An API
/// without microversions (empty `version`) supports only 2.1.
pub(super) fn parse_versions(body: &[u8]) -> Result<VersionRange, String> {
    let doc: VersionsDoc = serde_json::from_slice(body)
        .map_err(|e| format!("the version document is not what Nova answers: {e}"))?;
    let entry = doc
        .versions
        .iter()
        .chain(doc.version.as_ref())
        .find(|v| v.id == "v2.1")
        .ok_or("the version document has no v2.1 API")?;
    let parse = |s: &str, what: &str| match s.parse::<Microversion>() {
        Ok(Microversion::Exact(major, minor)) => Ok((major, minor)),
        _ => Err(format!(
            "the version document's {what} {s:?} is not a microversion"
        )),
    };
    if entry.version.is_empty() {
        return Ok(VersionRange {
            min: (2, 1),
            max: (2, 1),
        });
    }
    let max = parse(&entry.version, "version")?;
    let min = if entry.min_version.is_empty() {
        (2, 1)
    } else {
        parse(&entry.min_version, "min_version")?
    };
    Ok(VersionRange { min, max })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn microversions_are_2_n_or_latest() {
        assert_eq!("2.89".parse(), Ok(Microversion::Exact(2, 89)));
        assert_eq!("2.1".parse(), Ok(Microversion::Exact(2, 1)));
        assert_eq!("latest".parse(), Ok(Microversion::Latest));
        for bad in [
            "banana", "", "2", "2.", ".5", "2.0", "3.1", "2.x", "+2.5", "2.5.1", " 2.5", "Latest",
        ] {
            let e = bad.parse::<Microversion>().unwrap_err();
            assert!(e.contains("2.N"), "{bad}: {e}");
        }
        assert_eq!(Microversion::DEFAULT.to_string(), "2.89");
        assert_eq!(Microversion::Latest.to_string(), "latest");
    }

    #[test]
    fn the_version_document_is_read_from_the_contract_samples() {
        let root = include_bytes!("../../tests/fixtures/nova/versions/versions-get-resp.json");
        let range = parse_versions(root).unwrap();
        assert_eq!(
            range,
            VersionRange {
                min: (2, 1),
                max: (2, 104)
            }
        );
        let one = include_bytes!("../../tests/fixtures/nova/versions/v21-version-get-resp.json");
        assert_eq!(parse_versions(one).unwrap(), range);
        assert_eq!(range.choose(Microversion::Latest), Ok((2, 104)));
        assert_eq!(range.choose(Microversion::Exact(2, 89)), Ok((2, 89)));
        let e = range.choose(Microversion::Exact(2, 105)).unwrap_err();
        assert!(e.contains("2.1 to 2.104"), "{e}");
        assert!(parse_versions(b"{\"versions\": []}").is_err());
        assert!(parse_versions(b"<html>").is_err());
    }

    #[test]
    fn the_version_root_is_the_endpoint_up_to_its_version() {
        for (endpoint, root) in [
            ("http://127.0.0.1:8774/v2.1", "http://127.0.0.1:8774/"),
            (
                "http://h:8774/v2.1/a6944d763bf64ee6a275f1263fae0352",
                "http://h:8774/",
            ),
            (
                "https://cloud.example/compute/v2.1",
                "https://cloud.example/compute/",
            ),
            (
                "https://cloud.example/compute/v2/abc",
                "https://cloud.example/compute/",
            ),
            ("http://h:8774", "http://h:8774/"),
        ] {
            assert_eq!(version_root(endpoint), root, "{endpoint}");
        }
    }
}
