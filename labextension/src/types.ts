/**
 * Wire objects of LMSP 1.0 as the sidebar reads them: names for the schemas of the service's
 * OpenAPI document. `generated/lmsp.ts` is generated from that document (`openapi.json`, which
 * `make types` writes from jupyter_lmsp's models) by openapi-typescript, as a build step;
 * tests/test_labextension_types.py fails when either drifts from the models.
 */

import type { components } from './generated/lmsp';

type Schemas = components['schemas'];

export type IService = Schemas['Service'];
export type IWorkerInfo = Schemas['WorkerInfo'];
export type TaskState = Schemas['TaskState'];
export type ITask = Schemas['Task'];
export type ITaskList = Schemas['TaskList'];
export type IErrorObject = Schemas['ErrorDetail'];
/**
 * One event of a task's log: a union discriminated on `type` (one member per event type), so a
 * `switch (event.type)` or `'response' in event` narrows it to that event's fields.
 */
export type ITaskEvent = Schemas['Event'];
export type IEventPage = Schemas['EventPage'];
/** One transition of one of the caller's tasks (GET /lifecycle). */
export type ILifecycleEvent = Schemas['LifecycleEvent'];
export type IModel = Schemas['Model'];
export type IModelList = Schemas['ModelList'];
export type IPairing = Schemas['Pairing'];
export type IPairingList = Schemas['PairingList'];
export type IClient = Schemas['Client'];
export type IClientList = Schemas['ClientList'];
export type IRegisteringTask = Schemas['Task'];
export type IWebhookEndpoint = Schemas['WebhookEndpoint'];
export type IWebhookEndpointCreated = Schemas['WebhookEndpointCreated'];
export type IWebhookEndpointList = Schemas['WebhookEndpointList'];
export type IWebhookDelivery = Schemas['WebhookDelivery'];
export type IWebhookDeliveryList = Schemas['WebhookDeliveryList'];
export type WebhookEventType = Schemas['CreateWebhookEndpointRequest']['events'][number];
