/** Webhook endpoints (the owner's): URL, events, enabled, deliveries by state; add one (its
 * secret shown once, with a copy button), delete one, redeliver its dead letters. */

import * as React from 'react';

import { age, localTime } from '../format';
import type { SidebarModel } from '../model';
import type { WebhookEventType } from '../types';
import { WEBHOOK_EVENTS } from '../webhooks';
import type { IEndpointView, WebhooksModel } from '../webhooks';
import { Button, Empty, ErrorLine, Section } from './common';

/** "response.completed" -> "completed": the form and rows are narrow. */
function short(event: string): string {
  return event.replace(/^response\./, '');
}

function AddForm(props: { webhooks: WebhooksModel }): React.ReactElement {
  const [url, setUrl] = React.useState('');
  const [events, setEvents] = React.useState<WebhookEventType[]>(['response.completed']);
  const busy = props.webhooks.busy.has('add');
  const submit = (): void => {
    void props.webhooks.add(url, events).then(ok => {
      if (ok) {
        setUrl('');
      }
    });
  };
  return (
    <form
      className="jp-LMSP-webhookForm"
      onSubmit={event => {
        event.preventDefault();
        submit();
      }}
    >
      <input
        className="jp-LMSP-input"
        name="webhook-url"
        type="text"
        placeholder="https://host/path the events are POSTed to"
        aria-label="Webhook URL"
        value={url}
        onChange={event => setUrl(event.target.value)}
      />
      <fieldset className="jp-LMSP-webhookEvents">
        <legend>Events</legend>
        {WEBHOOK_EVENTS.map(type => (
          <label key={type} title={type}>
            <input
              type="checkbox"
              name="webhook-event"
              value={type}
              checked={events.includes(type)}
              onChange={event =>
                setEvents(
                  event.target.checked ? [...events, type] : events.filter(e => e !== type)
                )
              }
            />
            {short(type)}
          </label>
        ))}
      </fieldset>
      <Button name="add-webhook" label="Add endpoint" disabled={busy} onClick={submit} />
    </form>
  );
}

/** The secret of the endpoint just created: the service shows it in that answer only. */
function SecretOnce(props: { webhooks: WebhooksModel }): React.ReactElement | null {
  const created = props.webhooks.created;
  const [copied, setCopied] = React.useState<string | null>(null);
  if (!created) {
    return null;
  }
  const copy = (): void => {
    navigator.clipboard.writeText(created.secret).then(
      () => setCopied('Copied.'),
      (error: unknown) =>
        setCopied(`Not copied (${error instanceof Error ? error.message : String(error)}).`)
    );
  };
  return (
    <div className="jp-LMSP-secret" data-endpoint-id={created.id} role="status">
      <div className="jp-LMSP-secretNote">
        Signing secret of {created.url} — shown once: copy it now, it cannot be read again.
      </div>
      <code className="jp-LMSP-secretValue">{created.secret}</code>
      <div className="jp-LMSP-line">
        <Button name="copy-secret" label="Copy" title="Copy the secret" onClick={copy} />
        <Button
          name="forget-secret"
          label="Done"
          title="I have kept the secret: hide it"
          onClick={() => props.webhooks.forgetSecret()}
        />
        {copied ? <span className="jp-LMSP-copied">{copied}</span> : null}
      </div>
    </div>
  );
}

function EndpointRow(props: { view: IEndpointView; webhooks: WebhooksModel }): React.ReactElement {
  const { endpoint, dead } = props.view;
  const { webhooks } = props;
  const counts = endpoint.deliveries;
  return (
    <li
      className="jp-LMSP-row jp-LMSP-webhook"
      data-endpoint-id={endpoint.id}
      data-pending={counts.pending}
      data-delivered={counts.delivered}
      data-dead={counts.dead}
    >
      <div className="jp-LMSP-url" title={endpoint.url}>
        {endpoint.url}
      </div>
      <div className="jp-LMSP-line">
        <span className="jp-LMSP-sub jp-LMSP-grow jp-LMSP-wrap" title={endpoint.events.join(', ')}>
          {endpoint.events.map(short).join(' · ')}
        </span>
        <span
          className={`jp-LMSP-state jp-LMSP-state-${endpoint.enabled ? 'enabled' : 'disabled'}`}
        >
          {endpoint.enabled ? 'enabled' : 'disabled'}
        </span>
      </div>
      <div className="jp-LMSP-line jp-LMSP-lineWrap">
        <span className="jp-LMSP-sub jp-LMSP-grow jp-LMSP-wrap jp-LMSP-deliveryCounts">
          <span data-count="pending">{counts.pending} pending</span>
          {' · '}
          <span data-count="delivered">{counts.delivered} delivered</span>
          {' · '}
          <span data-count="dead" className={counts.dead ? 'jp-LMSP-deadCount' : undefined}>
            {counts.dead} dead
          </span>
        </span>
        <span className="jp-LMSP-actions">
          <Button
            name="delete-webhook"
            label="Delete"
            kind="warn"
            title="Delete this endpoint and its deliveries"
            disabled={webhooks.busy.has(`delete:${endpoint.id}`)}
            onClick={() => void webhooks.remove(endpoint.id)}
          />
        </span>
      </div>
      {dead.length ? (
        <ul className="jp-LMSP-list jp-LMSP-deadLetters">
          {dead.map(d => (
            <li key={d.id} className="jp-LMSP-deadLetter" data-delivery-id={d.id}>
              <div className="jp-LMSP-line jp-LMSP-lineWrap">
                <span
                  className="jp-LMSP-sub jp-LMSP-grow jp-LMSP-wrap"
                  title={d.last_error ?? undefined}
                >
                  <span>{short(d.event.type)}</span>
                  {' · '}
                  <span>{d.attempts} attempts</span>
                  {' · '}
                  <span>{d.last_status_code ?? d.last_error ?? 'no answer'}</span>
                </span>
                <span className="jp-LMSP-age" title={localTime(d.created_at)}>
                  {age(d.created_at)}
                </span>
                <Button
                  name="redeliver"
                  label="Redeliver"
                  title="Send it again, with its same webhook-id"
                  disabled={webhooks.busy.has(`redeliver:${d.id}`)}
                  onClick={() => void webhooks.redeliver(endpoint.id, d.id)}
                />
              </div>
            </li>
          ))}
        </ul>
      ) : null}
    </li>
  );
}

export function WebhooksView(props: { model: SidebarModel }): React.ReactElement {
  const webhooks = props.model.webhooks;
  const { data, loaded } = webhooks;
  const dead = data.reduce((n, v) => n + v.endpoint.deliveries.dead, 0);
  return (
    <Section
      title="Webhooks"
      name="webhooks"
      count={data.length}
      countLabel={`${data.length} endpoints, ${dead} dead deliveries`}
      error={webhooks.error}
    >
      <SecretOnce webhooks={webhooks} />
      {webhooks.actionError ? <ErrorLine text={webhooks.actionError} /> : null}
      {data.length ? (
        <ul className="jp-LMSP-list">
          {data.map(view => (
            <EndpointRow key={view.endpoint.id} view={view} webhooks={webhooks} />
          ))}
        </ul>
      ) : loaded ? (
        <Empty text="No webhook endpoints." />
      ) : null}
      <AddForm webhooks={webhooks} />
    </Section>
  );
}
