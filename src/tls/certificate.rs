//! What the service reads of an X.509 certificate itself, from its DER:
//! the subject (the last common name, the organizational units) and the
//! issuer's and subject's whole names, which name a caller presenting it,
//! and the end of its validity, which the
//! metrics report for the served certificate. Only the few fields read
//! here are parsed; a certificate rustls accepted is well formed, and
//! anything unexpected reads as `None`.

/// One DER element: (tag, contents, what follows it).
fn der_element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        // Long form: the next (first & 0x7f) bytes are the length.
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, b| (acc << 8) | usize::from(*b));
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

const SEQUENCE: u8 = 0x30;
const SET: u8 = 0x31;
/// id-at-commonName, 2.5.4.3.
const COMMON_NAME: &[u8] = &[0x55, 0x04, 0x03];
/// id-at-organizationalUnitName, 2.5.4.11.
const ORGANIZATIONAL_UNIT: &[u8] = &[0x55, 0x04, 0x0b];

/// What a certificate's subject says about its caller.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Subject {
    /// The last common name (as Kubernetes reads it), when readable and
    /// not blank.
    pub common_name: Option<String>,
    /// Every readable organizational unit, in order.
    pub units: Vec<String>,
}

/// The subject of a DER certificate. A certificate rustls accepted is well
/// formed; anything unexpected here reads as `None` (no subject), and an
/// attribute of a string kind not read here as absent.
pub fn subject_of(cert: &[u8]) -> Option<Subject> {
    // serialNumber, signature, issuer, validity, then subject.
    let mut rest = tbs_fields(cert)?;
    for _ in 0..4 {
        rest = der_element(rest)?.2;
    }
    let (SEQUENCE, mut rdns, _) = der_element(rest)? else {
        return None;
    };
    let mut subject = Subject::default();
    while !rdns.is_empty() {
        let (tag, mut set, next) = der_element(rdns)?;
        rdns = next;
        if tag != SET {
            return None;
        }
        while !set.is_empty() {
            let (_, pair, next) = der_element(set)?;
            set = next;
            let (_, oid, value) = der_element(pair)?;
            if oid == COMMON_NAME {
                subject.common_name = directory_string(value)?;
            } else if oid == ORGANIZATIONAL_UNIT
                && let Some(unit) = directory_string(value)?
            {
                subject.units.push(unit);
            }
        }
    }
    subject.common_name = subject.common_name.filter(|n| !n.trim().is_empty());
    Some(subject)
}

/// The issuer's and the subject's names of a DER certificate, each whole
/// (its DER element: tag, length and contents). Together they say whom a
/// CA vouched for — RFC 5280 (4.1.2.6) has a CA give each subject its own
/// name — so they stay the same across the renewals and key rotations of
/// one identity, and differ for another subject or another CA.
pub fn issuer_and_subject_of(cert: &[u8]) -> Option<(&[u8], &[u8])> {
    // serialNumber, signature, then issuer, validity, subject.
    let mut rest = tbs_fields(cert)?;
    for _ in 0..2 {
        rest = der_element(rest)?.2;
    }
    let (issuer, rest) = whole_sequence(rest)?;
    let (subject, _) = whole_sequence(der_element(rest)?.2)?;
    Some((issuer, subject))
}

/// The SEQUENCE `from` begins with, whole (tag and length too), and what
/// follows it.
fn whole_sequence(from: &[u8]) -> Option<(&[u8], &[u8])> {
    let (SEQUENCE, _, next) = der_element(from)? else {
        return None;
    };
    Some((&from[..from.len() - next.len()], next))
}

/// The fields of a DER certificate's TBSCertificate after its optional
/// version (`[0]`): serialNumber, signature, issuer, validity, subject...
fn tbs_fields(cert: &[u8]) -> Option<&[u8]> {
    let (SEQUENCE, cert, _) = der_element(cert)? else {
        return None;
    };
    let (SEQUENCE, tbs, _) = der_element(cert)? else {
        return None;
    };
    if tbs.first() == Some(&0xa0) {
        return Some(der_element(tbs)?.2);
    }
    Some(tbs)
}

/// The end of a DER certificate's validity (`notAfter`), or `None` when it
/// cannot be read (a certificate rustls accepted can be).
pub fn not_after_of(cert: &[u8]) -> Option<chrono::DateTime<chrono::Utc>> {
    // serialNumber, signature, issuer, then validity.
    let mut rest = tbs_fields(cert)?;
    for _ in 0..3 {
        rest = der_element(rest)?.2;
    }
    let (SEQUENCE, validity, _) = der_element(rest)? else {
        return None;
    };
    let not_before_rest = der_element(validity)?.2;
    let (tag, time, _) = der_element(not_before_rest)?;
    der_time(tag, time)
}

/// An X.509 Time (RFC 5280 4.1.2.5): UTCTime `YYMMDDHHMMSSZ` (years 1950
/// to 2049) or GeneralizedTime `YYYYMMDDHHMMSSZ`, both in UTC.
fn der_time(tag: u8, text: &[u8]) -> Option<chrono::DateTime<chrono::Utc>> {
    let text = std::str::from_utf8(text).ok()?.strip_suffix('Z')?;
    if !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let (year, rest) = match (tag, text.len()) {
        // UTCTime
        (0x17, 12) => {
            let yy: i32 = text[..2].parse().ok()?;
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, &text[2..])
        }
        // GeneralizedTime
        (0x18, 14) => (text[..4].parse().ok()?, &text[4..]),
        _ => return None,
    };
    let n = |i: usize| rest[i..i + 2].parse::<u32>().ok();
    chrono::NaiveDate::from_ymd_opt(year, n(0)?, n(2)?)?
        .and_hms_opt(n(4)?, n(6)?, n(8)?)
        .map(|t| t.and_utc())
}

/// The subject common name of a DER certificate: the last one when there
/// are several, as Kubernetes reads it.
pub fn common_name(cert: &[u8]) -> Option<String> {
    subject_of(cert)?.common_name
}

/// A DirectoryString's text (`Some(None)`: a kind not read here).
fn directory_string(value: &[u8]) -> Option<Option<String>> {
    let (tag, text, _) = der_element(value)?;
    Some(match tag {
        // UTF8String, PrintableString, IA5String.
        0x0c | 0x13 | 0x16 => std::str::from_utf8(text).ok().map(str::to_string),
        // BMPString: UTF-16, big-endian.
        0x1e if text.len() % 2 == 0 => String::from_utf16(
            &text
                .chunks(2)
                .map(|c| u16::from_be_bytes([c[0], c[1]]))
                .collect::<Vec<_>>(),
        )
        .ok(),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert_with(dn: &[(rcgen::DnType, rcgen::DnValue)]) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(vec!["orchestrator.example".into()]).unwrap();
        p.distinguished_name = rcgen::DistinguishedName::new();
        for (t, v) in dn {
            p.distinguished_name.push(t.clone(), v.clone());
        }
        p.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn a_certificates_not_after_is_read_in_both_time_forms() {
        let with_end = |end| {
            let key = rcgen::KeyPair::generate().unwrap();
            let mut p = rcgen::CertificateParams::new(vec!["localhost".into()]).unwrap();
            p.not_after = end;
            p.self_signed(&key).unwrap().der().to_vec()
        };
        // Up to 2049 a UTCTime, from 2050 a GeneralizedTime (RFC 5280).
        let utc = with_end(rcgen::date_time_ymd(2031, 5, 6));
        assert_eq!(
            not_after_of(&utc).map(|t| t.to_rfc3339()),
            Some("2031-05-06T00:00:00+00:00".to_string())
        );
        let generalized = with_end(rcgen::date_time_ymd(2061, 12, 31));
        assert_eq!(
            not_after_of(&generalized).map(|t| t.to_rfc3339()),
            Some("2061-12-31T00:00:00+00:00".to_string())
        );
        assert_eq!(
            der_time(0x17, b"991231235959Z").map(|t| t.timestamp()),
            Some(946_684_799)
        );
        assert_eq!(
            der_time(0x17, b"9912312359Z"),
            None,
            "seconds are required in DER"
        );
        assert_eq!(der_time(0x18, b"20311301000000Z"), None, "no 13th month");
        assert_eq!(not_after_of(b"not a certificate"), None);
    }

    #[test]
    fn a_certificate_names_its_caller_by_its_subject_common_name() {
        use rcgen::{DnType, DnValue};
        let named = cert_with(&[
            (DnType::OrganizationName, DnValue::Utf8String("ci".into())),
            (
                DnType::CommonName,
                DnValue::Utf8String("orchestrator-é".into()),
            ),
        ]);
        assert_eq!(common_name(&named).as_deref(), Some("orchestrator-é"));
        let printable = cert_with(&[(
            DnType::CommonName,
            DnValue::PrintableString("orchestrator-2".try_into().unwrap()),
        )]);
        assert_eq!(common_name(&printable).as_deref(), Some("orchestrator-2"));
        let bmp = cert_with(&[(
            DnType::CommonName,
            DnValue::BmpString("orchestrator-3".try_into().unwrap()),
        )]);
        assert_eq!(common_name(&bmp).as_deref(), Some("orchestrator-3"));
        let nameless = cert_with(&[(DnType::OrganizationName, DnValue::Utf8String("ci".into()))]);
        assert_eq!(common_name(&nameless), None);
        assert_eq!(common_name(b"not a certificate"), None);
        assert_eq!(common_name(&named[..named.len() / 2]), None);
    }

    #[test]
    fn the_issuer_and_the_subject_are_read_whole() {
        use rcgen::{DnType, DnValue};
        let cert = cert_with(&[(DnType::CommonName, DnValue::Utf8String("twin".into()))]);
        let (issuer, subject) = issuer_and_subject_of(&cert).unwrap();
        // Self-signed: the issuer is the subject, each one whole SEQUENCE.
        assert_eq!(issuer, subject);
        assert_eq!(
            der_element(subject).map(|(tag, _, rest)| (tag, rest.len())),
            Some((SEQUENCE, 0))
        );
        assert!(subject.windows(4).any(|w| w == b"twin"));
        assert_eq!(issuer_and_subject_of(b"not a certificate"), None);
        assert_eq!(issuer_and_subject_of(&cert[..cert.len() / 3]), None);
    }

    #[test]
    fn a_subject_gives_its_units_and_its_last_common_name() {
        use rcgen::{DnType, DnValue};
        // rcgen keeps one value per attribute type; a second OU comes from
        // a custom type with the same OID.
        let ou = DnType::CustomDnType(vec![2, 5, 4, 11]);
        let cert = cert_with(&[
            (
                DnType::OrganizationalUnitName,
                DnValue::Utf8String("sre".into()),
            ),
            (ou, DnValue::PrintableString("operator".try_into().unwrap())),
            (DnType::CommonName, DnValue::Utf8String("oncall".into())),
        ]);
        assert_eq!(
            subject_of(&cert),
            Some(Subject {
                common_name: Some("oncall".into()),
                units: vec!["sre".into(), "operator".into()],
            })
        );
    }
}
